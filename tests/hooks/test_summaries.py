"""Summary writing (SummarySaverHook, the writers) and profiling (ProfilerHook), read back
from the real files."""

from __future__ import annotations

import json
import logging
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    FakeClock,
    RecordingHook,
    RecordingWriter,
    checked_summary_step,
    count_step,
    float_zero,
    run_summaries,
    summary_step,
    windows,
    zero,
)
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import jaxmon as jm
from jaxmon._ops import report_thread as _off_loop
from jaxmon._writers import SummaryWriterCache

SIZE_GUIDANCE = {"scalars": 0, "histograms": 0, "images": 0, "tensors": 0}


def square_plus_one(state, batch, outputs):
    return state**2 + 1


def events(logdir):
    acc = EventAccumulator(str(logdir), size_guidance=SIZE_GUIDANCE)
    acc.Reload()
    return acc


def scalars(acc, tag):
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def jsonl(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def event_files(logdir):
    return sorted(name for name in os.listdir(logdir) if name.startswith("events.out.tfevents"))


def expected_outputs(steps, reduce):
    """`step`'s "loss" and "acc" as written at `steps`: the state after step t is t, so
    loss = 2 t and acc = t / 10 (in float32); reduce="last" takes the write step's."""
    picked = windows(steps) if reduce == "mean" else [np.array([s]) for s in steps]
    loss = [float(np.mean(2.0 * np.float32(ts))) for ts in picked]
    acc = [float(np.mean(np.float32(ts) / np.float32(10))) for ts in picked]
    return loss, acc


# -- argument checks -----------------------------------------------------------------


@pytest.mark.parametrize("kwargs, error", [
    ({"save_steps": 1}, ValueError),  # neither output_dir nor summary_writer
    ({"save_steps": 1, "output_dir": "x", "summary_writer": RecordingWriter()}, ValueError),
    ({"output_dir": "x"}, ValueError),  # neither save_steps nor save_secs
    ({"save_steps": 1, "save_secs": 1.0, "output_dir": "x"}, ValueError),
    ({"save_steps": 1, "summary_writer": object()}, TypeError),
    ({"save_steps": 1, "output_dir": "x", "summaries": ["loss"]}, TypeError),
    ({"save_steps": 1, "output_dir": "x", "summaries": "loss"}, TypeError),
    ({"save_steps": 1, "output_dir": "x", "reduce": "bogus"}, ValueError),
])
def test_summary_saver_hook_checks_its_arguments(kwargs, error):
    with pytest.raises(error):
        jm.SummarySaverHook(**kwargs)


def test_a_writer_with_only_some_of_the_protocol_methods_is_a_type_error():
    class Partial:
        def write_scalars(self, step, scalars):
            pass

        def flush(self):
            pass

    with pytest.raises(TypeError, match="SummaryWriter"):
        jm.SummarySaverHook(save_steps=1, summary_writer=Partial())


# -- when summaries are written -----------------------------------------------------


@pytest.mark.parametrize("reduce", ["last", "mean"])  # "last": TF's values of the write step
def test_save_steps_writes_every_scalar_output_and_extra_summaries_at_steps_1_8_16_24(tmp_path, reduce):
    hook = jm.SummarySaverHook(save_steps=8, output_dir=tmp_path, summaries={"sq": square_plus_one}, reduce=reduce)
    sess = run_summaries([hook], 30)
    assert sess.step == 30
    acc = events(tmp_path)
    steps = [1, 8, 16, 24]  # step 1, then every 8 steps counted from step 0
    loss, acc_values = expected_outputs(steps, reduce)  # mean: over steps 1, 1-8, 9-16, 17-24
    # the extra summary (a callable, state**2 + 1 with state = t after step t) is
    # reduced as the scalar outputs are: the write step's value, or its window mean
    picked = windows(steps) if reduce == "mean" else [np.array([s]) for s in steps]
    sq = [float(np.mean(np.float32(ts) ** 2 + 1)) for ts in picked]
    if reduce == "last":
        assert loss == [2.0 * s for s in steps]
        assert sq == [2.0, 65.0, 257.0, 577.0]
    else:
        assert loss == [2.0, 9.0, 25.0, 41.0]  # 2 * (1 + 8) / 2 = 9, 2 * (9 + 16) / 2 = 25, ...
        assert sq == [2.0, 26.5, 162.5, 426.5]  # 1 + (1 + 4 + ... + 64) / 8 = 1 + 204 / 8, 1 + 1292 / 8, ...
    assert set(acc.Tags()["scalars"]) == {"loss", "acc", "sq"}  # "vec" is not a scalar: not written
    assert [s for s, _ in scalars(acc, "loss")] == steps
    assert [v for _, v in scalars(acc, "loss")] == pytest.approx(loss, rel=1e-6)
    assert [s for s, _ in scalars(acc, "acc")] == steps
    assert [v for _, v in scalars(acc, "acc")] == pytest.approx(acc_values, rel=1e-6)
    assert scalars(acc, "sq") == [(s, pytest.approx(v, rel=1e-6)) for s, v in zip(steps, sq, strict=True)]
    lines = jsonl(tmp_path / "metrics.jsonl")
    assert [line["step"] for line in lines] == steps
    assert all("vec" not in line for line in lines)
    assert [line["loss"] for line in lines] == pytest.approx(loss, rel=1e-6)
    assert [line["sq"] for line in lines] == pytest.approx(sq, rel=1e-6)


def counter_loss_step(state, batch):
    """An int counter; "loss" reads the step number, as float32."""
    state = state + 1
    return state, {"loss": state.astype(jnp.float32)}


@pytest.mark.parametrize("steps_per_dispatch", [1, 8])
def test_event_file_loss_is_the_window_mean_and_last_with_reduce_last(tmp_path, steps_per_dispatch):
    steps = [1, 8, 16, 24]  # with 8 steps per run too: the runs are cut to end at them
    expected = {
        # the mean of the step numbers since the previous write, but the one at 8 covers steps from 1
        # (step 1's write ends no window): 1, (1 + 8) / 2, (9 + 16) / 2, (17 + 24) / 2
        "mean": [float(np.mean(ts)) for ts in windows(steps)],
        "last": [float(s) for s in steps],  # the write step's own value (TF)
    }
    assert expected["mean"] == [1.0, 4.5, 12.5, 20.5]
    for reduce, values in expected.items():
        logdir = tmp_path / reduce
        kwargs = {} if reduce == "mean" else {"reduce": "last"}  # "mean" is the default
        hook = jm.SummarySaverHook(save_steps=8, output_dir=logdir, **kwargs)
        with jm.MonitoredSession(counter_loss_step, zero, data=[np.float32(0)] * 25,
                                 steps_per_dispatch=steps_per_dispatch,
                                 hooks=[hook, jm.StopAtStepHook(last_step=25)]) as sess:
            while not sess.should_stop():
                sess.run()
        assert sess.step == 25
        assert len(event_files(logdir)) == 1
        assert scalars(events(logdir), "loss") == list(zip(steps, values, strict=True)), reduce


EVALUATIONS = []


def counted(state, batch, outputs):
    jax.debug.callback(lambda value: EVALUATIONS.append(float(value)), state)
    return state * 3


@pytest.mark.needs_cpu  # jax.debug.callback: its host side
def test_an_extra_summary_is_computed_only_on_the_steps_it_is_written(tmp_path):  # L2: counter reads 1, 2, 3, 4
    EVALUATIONS.clear()
    hook = jm.SummarySaverHook(save_steps=8, output_dir=tmp_path, summaries={"tripled": counted}, reduce="last")
    sess = run_summaries([hook], 30)
    jax.effects_barrier()
    assert EVALUATIONS == [1.0, 8.0, 16.0, 24.0]
    assert scalars(events(tmp_path), "tripled") == [(1, 3.0), (8, 24.0), (16, 48.0), (24, 72.0)]
    assert sess.compile_count == 2  # one variant with the summary, one without


@pytest.mark.needs_cpu  # jax.debug.callback: its host side
def test_an_extra_summary_with_reduce_mean_is_computed_every_step_and_written_as_its_window_mean(tmp_path):
    EVALUATIONS.clear()
    hook = jm.SummarySaverHook(save_steps=8, output_dir=tmp_path, summaries={"tripled": counted})  # reduce="mean"
    sess = run_summaries([hook], 30)
    jax.effects_barrier()
    assert EVALUATIONS == [float(t) for t in range(1, 31)]  # accumulated on the device on every step
    # 3 * mean of the steps 1, 1-8, 9-16, 17-24: 3 * 1, 3 * 4.5, 3 * 12.5, 3 * 20.5
    assert scalars(events(tmp_path), "tripled") == [(1, 3.0), (8, 13.5), (16, 37.5), (24, 61.5)]
    assert sess.compile_count == 1  # the summary is in every step: one variant


def metrics(state, batch, outputs):
    return {"double": outputs["loss"], "half": {"x": state / 2}}


def test_a_pytree_of_scalars_is_tagged_by_path(tmp_path):
    hook = jm.SummarySaverHook(save_steps=2, output_dir=tmp_path, summaries={"m": metrics, "l": "loss"})
    run_summaries([hook], 4)
    acc = events(tmp_path)
    # written after steps 1, 2, 4, each leaf the mean over its window: 1, 1-2, 3-4
    # (double = loss = 2 t: 2, 2 * 1.5, 2 * 3.5; half/x = t / 2: 0.5, 1.5 / 2, 3.5 / 2)
    assert [list(ts) for ts in windows([1, 2, 4])] == [[1], [1, 2], [3, 4]]
    assert scalars(acc, "m/double") == [(1, 2.0), (2, 3.0), (4, 7.0)]
    assert scalars(acc, "m/half/x") == [(1, 0.5), (2, 0.75), (4, 1.75)]
    assert scalars(acc, "l") == [(1, 2.0), (2, 3.0), (4, 7.0)]


def test_a_hook_used_again_in_a_new_session_keeps_the_absolute_schedule(tmp_path):  # 2.7: begin resets the timer
    hook = jm.SummarySaverHook(save_steps=8, output_dir=tmp_path)
    run_summaries([hook], 10)
    with jm.MonitoredSession(summary_step, float_zero, hooks=[hook], initial_step=10) as sess:
        for _ in range(6):
            sess.run()
    # the second session (steps 11-16) writes at 16, the next multiple of 8, not at its first step
    assert [line["step"] for line in jsonl(tmp_path / "metrics.jsonl")] == [1, 8, 16]


def test_save_secs_half_a_second_with_half_a_second_per_run_writes_every_step(tmp_path):
    clock = FakeClock()
    hook = jm.SummarySaverHook(save_secs=0.5, output_dir=tmp_path, clock=clock)
    run_summaries([hook], 4, clock=clock, dt=0.5)
    assert [s for s, _ in scalars(events(tmp_path), "loss")] == [1, 2, 3, 4]


@pytest.mark.parametrize("reduce", ["last", "mean"])
def test_save_secs_nine_with_3_1_seconds_per_run_writes_steps_1_4_7(tmp_path, reduce):
    clock = FakeClock()
    hook = jm.SummarySaverHook(save_secs=9, output_dir=tmp_path, clock=clock, reduce=reduce)
    run_summaries([hook], 8, clock=clock, dt=3.1)
    loss, _ = expected_outputs([1, 4, 7], reduce)
    # last (TF): 2 * step; mean: 2, then (step 1's write ends no window) 2 * (1 + 2 + 3 + 4) / 4 = 5,
    # 2 * (5 + 6 + 7) / 3 = 12
    assert loss == ([2.0, 8.0, 14.0] if reduce == "last" else [2.0, 5.0, 12.0])
    assert scalars(events(tmp_path), "loss") == list(zip([1, 4, 7], loss, strict=True))
    assert [line["step"] for line in jsonl(tmp_path / "metrics.jsonl")] == [1, 4, 7]


# -- summary kinds ---------------------------------------------------------------------


def params(state, batch, outputs):
    return {"w": jnp.arange(4.0) * state, "b": state}


def picture(state, batch, outputs):
    return jnp.ones((6, 8, 3)) * (state / 10)


def test_histogram_image_and_text_summaries(tmp_path):
    hook = jm.SummarySaverHook(save_steps=4, output_dir=tmp_path, summaries={
        "params": jm.Histogram(params),
        "img": jm.Image(picture),
        "note": jm.Text("loss", lambda v: f"loss is {float(v):.1f}"),
    })
    run_summaries([hook], 6)
    acc = events(tmp_path)
    assert {"params/w", "params/b"} <= set(acc.Tags()["histograms"])
    w = acc.Histograms("params/w")
    assert [e.step for e in w] == [1, 4]  # step 1, then every 4 steps: the write step's values
    assert [(e.histogram_value.num, e.histogram_value.min, e.histogram_value.max) for e in w] == [
        (4, 0.0, 3.0), (4, 0.0, 12.0)]
    b = acc.Histograms("params/b")
    assert [(e.step, e.histogram_value.num, e.histogram_value.sum) for e in b] == [(1, 1, 1.0), (4, 1, 4.0)]
    images = acc.Images("img")
    assert [(e.step, e.width, e.height) for e in images] == [(1, 8, 6), (4, 8, 6)]
    assert "note/text_summary" in acc.Tags()["tensors"]
    texts = [(e.step, e.tensor_proto.string_val[0].decode()) for e in acc.Tensors("note/text_summary")]
    assert texts == [(1, "loss is 2.0"), (4, "loss is 8.0")]
    # histograms and images stay out of the JSON lines; text goes on the step's line
    lines = jsonl(tmp_path / "metrics.jsonl")
    assert [(line["step"], line["note"]) for line in lines] == [(1, "loss is 2.0"), (4, "loss is 8.0")]
    assert not any(key.startswith(("params", "img")) for line in lines for key in line)


def flat_picture(state, batch, outputs):
    return jnp.ones((6, 8, 2)) * state


def test_an_image_of_the_wrong_shape_is_a_value_error(tmp_path):
    hook = jm.SummarySaverHook(save_steps=1, output_dir=tmp_path, summaries={"img": jm.Image(flat_picture)})
    with pytest.raises(ValueError, match=r"\(6, 8, 2\)"):
        run_summaries([hook], 3)


def test_a_non_scalar_plain_summary_is_a_value_error_naming_the_shape(tmp_path):
    hook = jm.SummarySaverHook(save_steps=1, output_dir=tmp_path, summaries={"v": "vec"})
    with pytest.raises(ValueError, match=r"\(3,\)") as info:
        with jm.MonitoredSession(summary_step, float_zero, hooks=[hook]) as sess:
            for _ in range(3):
                sess.run()
    assert "jm.Histogram" in str(info.value)
    # Step 1's values go to the report thread during run 2; what fails there is raised after run 3's step
    # (if the thread is done by then) or by close(): either way once the third step has run.
    assert sess.step == 3
    assert any("after_run at step 1" in note for note in getattr(info.value, "__notes__", []))


def test_a_non_scalar_plain_summary_with_on_error_warn_logs_and_training_goes_on(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="jaxmon")
    hook = jm.SummarySaverHook(save_steps=1, output_dir=tmp_path, summaries={"v": "vec"}, on_error="warn")
    sess = run_summaries([hook], 5)
    assert sess.step == 5
    warnings = [r for r in caplog.records if r.name == "jaxmon" and r.levelno == logging.WARNING]
    assert warnings
    assert any("SummarySaverHook" in r.getMessage() and "(3,)" in r.getMessage() for r in warnings)


# -- hyper-parameters ----------------------------------------------------------------


def test_hparams_are_written_once_even_after_a_recovery(tmp_path):
    hparams = {"lr": 0.1, "opt": {"name": "adam"}}
    aborter = RecordingHook(raise_in={"before_run": (3, jm.AbortedError("x"))})
    hook = jm.SummarySaverHook(save_steps=1, output_dir=tmp_path, hparams=hparams)
    with jm.MonitoredSession(summary_step, float_zero, hooks=[aborter, hook]) as sess:
        path = tmp_path / "hparams.json"
        first = path.read_text()
        assert json.loads(first) == {"lr": 0.1, "opt.name": "adam"}
        for _ in range(5):
            sess.run()
    assert aborter.calls["after_create_session"] == 2  # the recovery happened
    assert path.read_text() == first
    acc = events(tmp_path)
    assert "hparams/text_summary" in acc.Tags()["tensors"]
    table = acc.Tensors("hparams/text_summary")
    assert len(table) == 1
    text = table[0].tensor_proto.string_val[0].decode()
    assert "lr" in text and "0.1" in text and "opt.name" in text and "adam" in text
    assert "_hparams_/session_start_info" in acc.PluginTagToContent("hparams")  # the HParams dashboard


# -- JSON lines --------------------------------------------------------------------------


def test_two_hooks_writing_one_step_share_one_jsonl_line(tmp_path):
    clock = FakeClock()
    hooks = [
        jm.SummarySaverHook(save_steps=1, output_dir=tmp_path),
        jm.StepCounterHook(every_n_steps=1, output_dir=tmp_path, clock=clock),
    ]
    run_summaries(hooks, 6, clock=clock, dt=0.5)
    lines = jsonl(tmp_path / "metrics.jsonl")
    assert [line["step"] for line in lines] == [1, 2, 3, 4, 5, 6]
    assert all("wall_time" in line and isinstance(line["wall_time"], float) for line in lines)
    assert [line["loss"] for line in lines] == [2.0 * s for s in range(1, 7)]
    assert "global_step/sec" not in lines[0]  # the clock starts after the first run (which compiles)
    assert [line["global_step/sec"] for line in lines[1:]] == pytest.approx([2.0] * 5)
    assert len(event_files(tmp_path)) == 1


def nonfinite_step(state, batch):
    state = state + 1.0
    return state, {"nan": state * jnp.nan, "inf": state * jnp.inf, "ninf": -state * jnp.inf, "ok": state}


def test_non_finite_values_are_written_as_strings(tmp_path):
    hook = jm.SummarySaverHook(save_steps=1, output_dir=tmp_path)
    with jm.MonitoredSession(nonfinite_step, float_zero, hooks=[hook]) as sess:
        sess.run()
        sess.run()
    lines = jsonl(tmp_path / "metrics.jsonl")
    assert [(line["step"], line["nan"], line["inf"], line["ninf"], line["ok"]) for line in lines] == [
        (1, "nan", "inf", "-inf", 1.0), (2, "nan", "inf", "-inf", 2.0)]
    acc = events(tmp_path)
    assert math.isnan(acc.Scalars("nan")[0].value) and acc.Scalars("inf")[0].value == math.inf


def test_the_jsonl_file_is_complete_after_close(tmp_path):
    hook = jm.SummarySaverHook(save_steps=1, output_dir=tmp_path)
    run_summaries([hook], 7)
    lines = jsonl(tmp_path / "metrics.jsonl")
    assert [line["step"] for line in lines] == list(range(1, 8))  # the last step (read late) included
    assert [line["loss"] for line in lines] == [2.0 * s for s in range(1, 8)]
    assert [s for s, _ in scalars(events(tmp_path), "loss")] == list(range(1, 8))


def test_pending_summaries_are_written_when_the_step_raises(tmp_path):
    hook = jm.SummarySaverHook(save_steps=8, output_dir=tmp_path)
    with pytest.raises(ValueError, match="scalar batch"):
        with jm.MonitoredSession(checked_summary_step, float_zero, hooks=[hook]) as sess:
            for i in range(1, 12):
                sess.run(np.zeros(2, np.float32) if i == 9 else np.float32(0))
    assert sess.step == 8  # step 8's summaries, due to be read during run 9, are still written
    assert [line["step"] for line in jsonl(tmp_path / "metrics.jsonl")] == [1, 8]
    loss, _ = expected_outputs([1, 8], "mean")  # 2, then 2 * (1 + 8) / 2 = 9 over steps 1-8
    assert loss == [2.0, 9.0]
    assert scalars(events(tmp_path), "loss") == [(1, loss[0]), (8, loss[1])]


# -- the shared writer cache ---------------------------------------------------------------


def test_hooks_with_one_output_dir_share_one_writer_and_one_event_file(tmp_path):
    clock = FakeClock()
    hooks = [
        jm.SummarySaverHook(save_steps=2, output_dir=tmp_path),
        jm.StepCounterHook(every_n_steps=2, output_dir=tmp_path, clock=clock),
    ]
    key = os.path.abspath(tmp_path)
    with jm.MonitoredSession(summary_step, float_zero, hooks=hooks) as sess:
        assert SummaryWriterCache._writers[key][1] == 2  # two handles on one writer
        for _ in range(5):
            sess.run()
            clock.t += 1.0
    assert key not in SummaryWriterCache._writers  # closed and removed with its last handle
    assert len(event_files(tmp_path)) == 1
    acc = events(tmp_path)
    assert [s for s, _ in scalars(acc, "loss")] == [1, 2, 4]
    # the rate's clock starts after step 1: step 2 over 1 step in 1 s, steps 3-4 in 2 s
    assert scalars(acc, "global_step/sec") == [(2, pytest.approx(1.0)), (4, pytest.approx(1.0))]


def test_a_session_that_fails_to_start_releases_the_cached_writer(tmp_path):  # Hook.close: "on every exit"
    def broken_init():
        raise ValueError("no state")

    hook = jm.SummarySaverHook(save_steps=1, output_dir=tmp_path)
    with pytest.raises(ValueError, match="no state"):
        jm.MonitoredSession(summary_step, broken_init, hooks=[hook])
    key = os.path.abspath(tmp_path)
    try:
        assert key not in SummaryWriterCache._writers
    finally:  # do not leak the writer into the other tests
        entry = SummaryWriterCache._writers.pop(key, None)
        if entry is not None:
            entry[0].close()


def test_the_cache_gives_a_fresh_writer_after_the_last_handle_closed(tmp_path):
    first = SummaryWriterCache.get(tmp_path)
    second = SummaryWriterCache.get(tmp_path)
    assert first.writer is second.writer
    first.close()
    first.close()  # a second close of one handle releases nothing more
    assert os.path.abspath(tmp_path) in SummaryWriterCache._writers
    second.close()
    assert os.path.abspath(tmp_path) not in SummaryWriterCache._writers
    third = SummaryWriterCache.get(tmp_path)
    try:
        assert third.writer is not first.writer
    finally:
        third.close()


def test_a_given_writer_gets_the_scalars_and_is_flushed_but_never_closed():
    writer = RecordingWriter()
    hook = jm.SummarySaverHook(save_steps=2, summary_writer=writer, hparams={"lr": 0.5})
    run_summaries([hook], 5)
    writes = [call for call in writer.calls if call[0] not in ("flush", "close")]
    loss, acc = expected_outputs([1, 2, 4], "mean")  # over steps 1, 1-2, 3-4
    assert loss == [2.0, 3.0, 7.0]  # 2 * 1, 2 * (1 + 2) / 2, 2 * (3 + 4) / 2
    assert writes == [
        ("hparams", None, {"lr": 0.5}),
        ("scalars", 1, {"loss": loss[0], "acc": pytest.approx(acc[0], rel=1e-6)}),
        ("scalars", 2, {"loss": loss[1], "acc": pytest.approx(acc[1], rel=1e-6)}),
        ("scalars", 4, {"loss": loss[2], "acc": pytest.approx(acc[2], rel=1e-6)}),
    ]
    assert ("flush",) in writer.calls[writer.calls.index(writes[-1]):]  # flushed after the last write
    assert ("close",) not in writer.calls


# -- late delivery and compilation ---------------------------------------------------------


def test_values_are_written_one_run_late_or_at_sync(tmp_path):
    path = tmp_path / "metrics.jsonl"
    writer = jm.JsonlWriter(path)
    hook = jm.SummarySaverHook(save_steps=1, summary_writer=writer)
    try:
        with jm.MonitoredSession(summary_step, float_zero, hooks=[hook]) as sess:
            sess.run()
            _off_loop.wait()  # nothing queued on the report thread yet
            writer.flush()
            assert jsonl(path) == []  # step 1 is read during the next run, not now
            sess.run()
            _off_loop.wait()  # the next run queued step 1's report
            writer.flush()
            assert [line["step"] for line in jsonl(path)] == [1]
            sess.sync()
            writer.flush()
            assert [line["step"] for line in jsonl(path)] == [1, 2]
    finally:
        writer.close()
    assert [line["loss"] for line in jsonl(path)] == [2.0, 4.0]


def test_an_output_that_is_the_donated_state_is_still_read_one_run_late(tmp_path):
    hook = jm.SummarySaverHook(save_steps=1, output_dir=tmp_path)
    with jm.MonitoredSession(count_step, zero, hooks=[hook]) as sess:  # outputs {"value": state}
        for _ in range(4):
            sess.run()
    assert [(line["step"], line["value"]) for line in jsonl(tmp_path / "metrics.jsonl")] == [
        (1, 1), (2, 2), (3, 3), (4, 4)]


def test_writing_output_scalars_compiles_the_step_once(tmp_path):
    hook = jm.SummarySaverHook(save_steps=3, output_dir=tmp_path)
    sess = run_summaries([hook], 20)
    assert sess.compile_count == 1
    assert [s for s, _ in scalars(events(tmp_path), "loss")] == [1, 3, 6, 9, 12, 15, 18]


# -- the report thread ---------------------------------------------------------------------


def test_summaries_are_written_on_the_writers_thread_and_on_disk_at_close(tmp_path, monkeypatch):
    import threading

    from jaxmon._writers.jsonl import JsonlWriter

    threads, write = [], JsonlWriter.write_scalars
    monkeypatch.setattr(JsonlWriter, "write_scalars",
                        lambda self, *args: (threads.append(threading.current_thread().name), write(self, *args))[1])
    run_summaries([jm.SummarySaverHook(save_steps=2, output_dir=tmp_path)], 6)
    assert threads and set(threads) == {"jaxmon-report"}  # the loop only queued them
    steps = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 4, 6]


def test_a_summary_write_that_fails_on_the_writers_thread_stops_the_next_run(tmp_path, monkeypatch):
    import time

    from jaxmon._writers.jsonl import JsonlWriter

    def full(self, step, scalars):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(JsonlWriter, "write_scalars", full)
    hook = jm.SummarySaverHook(save_steps=2, output_dir=tmp_path)
    with pytest.raises(OSError, match="No space left on device") as raised:
        with jm.MonitoredSession(summary_step, float_zero, hooks=[hook]) as sess:
            for _ in range(6):
                sess.run()
                time.sleep(0.2)  # the report thread has written (and failed) before the next run
    # Step 1's summaries are delivered late, written during run 2; run 3 raised after its step.
    assert sess.step == 3
    assert "(raised in" not in "".join(getattr(raised.value, "__notes__", []))  # the writer's, not a hook's
