"""SummarySaverHook: its arguments, when it writes, the kinds of summary, the
hyper-parameters, and values delivered a run late, read back from the real files. (The
writers themselves: tests/writers/.)"""

import json
import logging

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
    event_files,
    event_scalars,
    expected_outputs,
    float_zero,
    read_events,
    read_jsonl,
    run_summaries,
    summary_step,
    windows,
    zero,
)

import jaxmon as jm
from jaxmon._ops import report_thread as _off_loop


def square_plus_one(state, batch, outputs):
    return state**2 + 1


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


# -- when summaries are written -----------------------------------------------------


@pytest.mark.parametrize("reduce", ["last", "mean"])  # "last": TF's values of the write step
def test_save_steps_writes_every_scalar_output_and_extra_summaries_at_steps_1_8_16_24(tmp_path, reduce):
    hook = jm.SummarySaverHook(save_steps=8, output_dir=tmp_path, summaries={"sq": square_plus_one}, reduce=reduce)
    sess = run_summaries([hook], 30)
    assert sess.step == 30
    acc = read_events(tmp_path)
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
    assert [s for s, _ in event_scalars(acc, "loss")] == steps
    assert [v for _, v in event_scalars(acc, "loss")] == pytest.approx(loss, rel=1e-6)
    assert [s for s, _ in event_scalars(acc, "acc")] == steps
    assert [v for _, v in event_scalars(acc, "acc")] == pytest.approx(acc_values, rel=1e-6)
    assert event_scalars(acc, "sq") == [(s, pytest.approx(v, rel=1e-6)) for s, v in zip(steps, sq, strict=True)]
    lines = read_jsonl(tmp_path / "metrics.jsonl")
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
        assert event_scalars(read_events(logdir), "loss") == list(zip(steps, values, strict=True)), reduce


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
    assert event_scalars(read_events(tmp_path), "tripled") == [(1, 3.0), (8, 24.0), (16, 48.0), (24, 72.0)]
    assert sess.compile_count == 2  # one variant with the summary, one without


@pytest.mark.needs_cpu  # jax.debug.callback: its host side
def test_an_extra_summary_with_reduce_mean_is_computed_every_step_and_written_as_its_window_mean(tmp_path):
    EVALUATIONS.clear()
    hook = jm.SummarySaverHook(save_steps=8, output_dir=tmp_path, summaries={"tripled": counted})  # reduce="mean"
    sess = run_summaries([hook], 30)
    jax.effects_barrier()
    assert EVALUATIONS == [float(t) for t in range(1, 31)]  # accumulated on the device on every step
    # 3 * mean of the steps 1, 1-8, 9-16, 17-24: 3 * 1, 3 * 4.5, 3 * 12.5, 3 * 20.5
    assert event_scalars(read_events(tmp_path), "tripled") == [(1, 3.0), (8, 13.5), (16, 37.5), (24, 61.5)]
    assert sess.compile_count == 1  # the summary is in every step: one variant


def metrics(state, batch, outputs):
    return {"double": outputs["loss"], "half": {"x": state / 2}}


def test_a_pytree_of_scalars_is_tagged_by_path(tmp_path):
    hook = jm.SummarySaverHook(save_steps=2, output_dir=tmp_path, summaries={"m": metrics, "l": "loss"})
    run_summaries([hook], 4)
    acc = read_events(tmp_path)
    # written after steps 1, 2, 4, each leaf the mean over its window: 1, 1-2, 3-4
    # (double = loss = 2 t: 2, 2 * 1.5, 2 * 3.5; half/x = t / 2: 0.5, 1.5 / 2, 3.5 / 2)
    assert [list(ts) for ts in windows([1, 2, 4])] == [[1], [1, 2], [3, 4]]
    assert event_scalars(acc, "m/double") == [(1, 2.0), (2, 3.0), (4, 7.0)]
    assert event_scalars(acc, "m/half/x") == [(1, 0.5), (2, 0.75), (4, 1.75)]
    assert event_scalars(acc, "l") == [(1, 2.0), (2, 3.0), (4, 7.0)]


def test_a_hook_used_again_in_a_new_session_keeps_the_absolute_schedule(tmp_path):  # 2.7: begin resets the timer
    hook = jm.SummarySaverHook(save_steps=8, output_dir=tmp_path)
    run_summaries([hook], 10)
    with jm.MonitoredSession(summary_step, float_zero, hooks=[hook], initial_step=10) as sess:
        for _ in range(6):
            sess.run()
    # the second session (steps 11-16) writes at 16, the next multiple of 8, not at its first step
    assert [line["step"] for line in read_jsonl(tmp_path / "metrics.jsonl")] == [1, 8, 16]


def test_save_secs_half_a_second_with_half_a_second_per_run_writes_every_step(tmp_path):
    clock = FakeClock()
    hook = jm.SummarySaverHook(save_secs=0.5, output_dir=tmp_path, clock=clock)
    run_summaries([hook], 4, clock=clock, dt=0.5)
    assert [s for s, _ in event_scalars(read_events(tmp_path), "loss")] == [1, 2, 3, 4]


@pytest.mark.parametrize("reduce", ["last", "mean"])
def test_save_secs_nine_with_3_1_seconds_per_run_writes_steps_1_4_7(tmp_path, reduce):
    clock = FakeClock()
    hook = jm.SummarySaverHook(save_secs=9, output_dir=tmp_path, clock=clock, reduce=reduce)
    run_summaries([hook], 8, clock=clock, dt=3.1)
    loss, _ = expected_outputs([1, 4, 7], reduce)
    # last (TF): 2 * step; mean: 2, then (step 1's write ends no window) 2 * (1 + 2 + 3 + 4) / 4 = 5,
    # 2 * (5 + 6 + 7) / 3 = 12
    assert loss == ([2.0, 8.0, 14.0] if reduce == "last" else [2.0, 5.0, 12.0])
    assert event_scalars(read_events(tmp_path), "loss") == list(zip([1, 4, 7], loss, strict=True))
    assert [line["step"] for line in read_jsonl(tmp_path / "metrics.jsonl")] == [1, 4, 7]


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
    acc = read_events(tmp_path)
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
    lines = read_jsonl(tmp_path / "metrics.jsonl")
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
    acc = read_events(tmp_path)
    assert "hparams/text_summary" in acc.Tags()["tensors"]
    table = acc.Tensors("hparams/text_summary")
    assert len(table) == 1
    text = table[0].tensor_proto.string_val[0].decode()
    assert "lr" in text and "0.1" in text and "opt.name" in text and "adam" in text
    assert "_hparams_/session_start_info" in acc.PluginTagToContent("hparams")  # the HParams dashboard


def test_the_jsonl_file_is_complete_after_close(tmp_path):
    hook = jm.SummarySaverHook(save_steps=1, output_dir=tmp_path)
    run_summaries([hook], 7)
    lines = read_jsonl(tmp_path / "metrics.jsonl")
    assert [line["step"] for line in lines] == list(range(1, 8))  # the last step (read late) included
    assert [line["loss"] for line in lines] == [2.0 * s for s in range(1, 8)]
    assert [s for s, _ in event_scalars(read_events(tmp_path), "loss")] == list(range(1, 8))


def test_pending_summaries_are_written_when_the_step_raises(tmp_path):
    hook = jm.SummarySaverHook(save_steps=8, output_dir=tmp_path)
    with pytest.raises(ValueError, match="scalar batch"):
        with jm.MonitoredSession(checked_summary_step, float_zero, hooks=[hook]) as sess:
            for i in range(1, 12):
                sess.run(np.zeros(2, np.float32) if i == 9 else np.float32(0))
    assert sess.step == 8  # step 8's summaries, due to be read during run 9, are still written
    assert [line["step"] for line in read_jsonl(tmp_path / "metrics.jsonl")] == [1, 8]
    loss, _ = expected_outputs([1, 8], "mean")  # 2, then 2 * (1 + 8) / 2 = 9 over steps 1-8
    assert loss == [2.0, 9.0]
    assert event_scalars(read_events(tmp_path), "loss") == [(1, loss[0]), (8, loss[1])]


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
            assert read_jsonl(path) == []  # step 1 is read during the next run, not now
            sess.run()
            _off_loop.wait()  # the next run queued step 1's report
            writer.flush()
            assert [line["step"] for line in read_jsonl(path)] == [1]
            sess.sync()
            writer.flush()
            assert [line["step"] for line in read_jsonl(path)] == [1, 2]
    finally:
        writer.close()
    assert [line["loss"] for line in read_jsonl(path)] == [2.0, 4.0]


def test_an_output_that_is_the_donated_state_is_still_read_one_run_late(tmp_path):
    hook = jm.SummarySaverHook(save_steps=1, output_dir=tmp_path)
    with jm.MonitoredSession(count_step, zero, hooks=[hook]) as sess:  # outputs {"value": state}
        for _ in range(4):
            sess.run()
    assert [(line["step"], line["value"]) for line in read_jsonl(tmp_path / "metrics.jsonl")] == [
        (1, 1), (2, 2), (3, 3), (4, 4)]


def test_writing_output_scalars_compiles_the_step_once(tmp_path):
    hook = jm.SummarySaverHook(save_steps=3, output_dir=tmp_path)
    sess = run_summaries([hook], 20)
    assert sess.compile_count == 1
    assert [s for s, _ in event_scalars(read_events(tmp_path), "loss")] == [1, 3, 6, 9, 12, 15, 18]
