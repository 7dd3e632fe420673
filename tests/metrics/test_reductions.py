"""Reductions as values (`jm.Mean(weight=)`, `jm.Sum`, `jm.Ratio`, `jm.Last`, `.then`)
wherever a hook reports, the one schedule ("every N steps" acts after N, 2N, ...), and
the windows a checkpoint keeps, read back from real event files and metrics.jsonl."""

from __future__ import annotations

import functools
import io
import json
import logging

import jax.numpy as jnp
import numpy as np
import pytest
from helpers import FakeClock, forever, windows
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import jaxmon as jm

STEPS = 30


def step_fn(state, batch):
    """The state after step t is t; the outputs are chosen so that every reduction's
    window value has a closed form: loss t, a token count 1 + t % 3, the loss summed
    over those tokens, and an integer."""
    state = state + 1.0
    tokens = 1.0 + state % 3
    return state, {"loss": state, "tokens": tokens, "loss_sum": state * tokens, "count": state.astype(jnp.int32)}


def init_fn():
    return jnp.zeros((), jnp.float32)


def loss(t):
    return np.float64(t)


def tokens(t):
    return 1.0 + t % 3


def tensorboard(logdir):
    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return acc


def scalars(logdir, tag):
    return [(e.step, e.value) for e in tensorboard(logdir).Scalars(tag)]


def lines(logdir):
    with open(logdir / "metrics.jsonl", encoding="utf-8") as f:
        return [json.loads(line) for line in f if '"step"' in line]


def train(hooks, *, k=1, last_step=STEPS, checkpoint_dir=None):
    stop = jm.StopAtStepHook(last_step=last_step)
    with jm.MonitoredSession(step_fn, init_fn, data=forever(), hooks=[*hooks, stop], steps_per_dispatch=k,
                             checkpoint_dir=checkpoint_dir) as sess:
        while not sess.should_stop():
            sess.run()
    return sess


WRITES = [1, 8, 16, 24]


@pytest.mark.parametrize("k", [1, 4])
def test_summaries_every_8_steps_write_steps_1_8_16_24_with_the_window_means(tmp_path, k):
    train([jm.SummarySaverHook(save_steps=8, output_dir=tmp_path)], k=k)
    # The loss at step t is t; windows 1 (the starting point, which ends no window), 1-8,
    # 9-16 and 17-24: the means 1, (1 + 8) / 2 = 4.5, (9 + 16) / 2 = 12.5, (17 + 24) / 2 = 20.5.
    means = [1.0, 4.5, 12.5, 20.5]
    assert means == [float(np.mean([loss(t) for t in w])) for w in windows(WRITES)]
    assert scalars(tmp_path, "loss") == list(zip(WRITES, means, strict=True))
    assert [line["step"] for line in lines(tmp_path)] == WRITES
    assert [line["loss"] for line in lines(tmp_path)] == means


@pytest.mark.parametrize("k", [1, 4])
def test_every_reduction_gives_its_exact_window_value(tmp_path, k):
    summaries = {
        "ratio": jm.Ratio("loss_sum", "tokens"),
        "weighted": jm.Mean("loss", weight="tokens"),
        "sum": jm.Sum("tokens"),
        "last": jm.Last("count"),
        "ppl": jm.Ratio("loss_sum", "tokens").then(np.exp),
        "callable": jm.Mean(lambda state, batch, outputs: outputs["loss"] * 2),
    }
    train([jm.SummarySaverHook(save_steps=8, output_dir=tmp_path, summaries=summaries, output_scalars=False)], k=k)
    ratio = [sum(loss(t) * tokens(t) for t in w) / sum(tokens(t) for t in w) for w in windows(WRITES)]
    expected = {
        "ratio": ratio,
        "weighted": ratio,
        "sum": [sum(tokens(t) for t in w) for w in windows(WRITES)],
        "last": [float(w[-1]) for w in windows(WRITES)],
        "ppl": list(np.exp(ratio)),
        "callable": [2 * np.mean([loss(t) for t in w]) for w in windows(WRITES)],
    }
    written = lines(tmp_path)
    assert [line["step"] for line in written] == WRITES
    for tag, values in expected.items():
        assert [line[tag] for line in written] == pytest.approx(values, rel=1e-6), tag
        assert [s for s, _ in scalars(tmp_path, tag)] == WRITES, tag
    assert written[0]["last"] == 1 and isinstance(written[0]["last"], int)  # an integer stays one


def test_a_reduction_is_a_value_with_pure_functions():
    ratio = jm.Ratio("loss_sum", "tokens")
    shapes = {"numerator": jnp.zeros(()), "denominator": jnp.zeros(())}
    acc = ratio.init(shapes)
    for numerator, denominator in [(6.0, 3.0), (2.0, 1.0)]:
        acc = ratio.update(acc, {"numerator": numerator, "denominator": denominator}, jnp.int32(1))
    assert float(ratio.result(acc, 2)) == 2.0 and float(ratio.init(shapes)["numerator"]) == 0.0  # init untouched
    assert repr(ratio.then(np.exp)) == "Ratio('loss_sum', 'tokens').then(exp)"
    assert repr(jm.Mean("loss", weight="tokens")) == "Mean('loss', weight='tokens')"
    with pytest.raises(TypeError, match="then"):
        ratio.then(3)
    with pytest.raises(TypeError, match="Mean weight must be an output name or a callable"):
        jm.Mean("loss", weight=2.0)
    with pytest.raises(TypeError, match="Ratio takes an output name or a callable"):
        jm.Ratio(["a", "b"], "c")


def test_a_mean_weight_must_be_one_number_per_step(tmp_path):
    hook = jm.SummarySaverHook(save_steps=8, output_dir=tmp_path,
                               summaries={"bad": jm.Mean("loss", weight=lambda state, batch, outputs: jnp.ones(3))})
    with pytest.raises(ValueError, match=r"weighs each step by one number; its weight has shape \(3,\)"):
        train([hook])


def test_a_reduction_naming_a_missing_output_says_which_outputs_there_are(tmp_path):
    hook = jm.LoggingHook({"x": jm.Ratio("loss_sum", "tokns")}, every_n_iter=2)
    with pytest.raises(ValueError, match=r"reduces 'tokns', which is not an output.*'tokens'"):
        train([hook])


def test_logging_reports_reductions_and_callables_as_window_values_with_5_digits(caplog):
    caplog.set_level(logging.INFO, logger="jaxmon")
    hook = jm.LoggingHook({"loss": "loss", "ratio": jm.Ratio("loss_sum", "tokens"),
                           "third": lambda state, batch, outputs: outputs["loss"] / 3}, every_n_iter=8)
    train([hook], k=4, last_step=16)
    logged = [r.getMessage() for r in caplog.records if r.getMessage().startswith("step ")]
    assert [line.split(":")[0] for line in logged] == ["step 1", "step 8", "step 16"]
    ratio = sum(loss(t) * tokens(t) for t in range(9, 17)) / sum(tokens(t) for t in range(9, 17))
    assert logged[2].startswith(f"step 16: loss = 12.5, ratio = {ratio:.5g}, third = 4.1667 (")
    assert logged[0] == "step 1: loss = 1, ratio = 1, third = 0.33333"  # a session's first line: no timing


def test_logging_at_end_gives_a_reduction_over_the_last_step(caplog):
    caplog.set_level(logging.INFO, logger="jaxmon")
    train([jm.LoggingHook({"ratio": jm.Ratio("loss_sum", "tokens"), "loss": "loss"}, at_end=True)], last_step=5)
    assert [r.getMessage() for r in caplog.records if r.getMessage().startswith("step ")] == [
        "step 5: loss = 5, ratio = 5"]


class Terminal(io.StringIO):
    def isatty(self):
        return True


def test_the_progress_bar_shows_reductions_and_keeps_its_metrics_to_the_end():
    stream, clock = Terminal(), FakeClock()
    hook = jm.ProgressBarHook(fetches={"loss": "loss", "ratio": jm.Ratio("loss_sum", "tokens")}, stream=stream,
                              enabled=True, every_n_secs=100.0, clock=clock)
    train([hook], last_step=6)
    frames = stream.getvalue().split("\r")[1:]
    ratio = sum(loss(t) * tokens(t) for t in range(1, 7)) / sum(tokens(t) for t in range(1, 7))
    assert "loss 3.5" in frames[-1] and f"ratio {ratio:.4g}" in frames[-1]  # the whole run: one refresh at the end


# -- evaluation -------------------------------------------------------------------------------------

# Batches of 3, 7, 1 and 5 rows whose masks keep 2, 6, 1 and 1 tokens: unequal token counts
# that are not the batch sizes either.
EVAL_BATCHES = [{"x": np.arange(n, dtype=np.float32), "mask": (np.arange(n) < kept).astype(np.float32)}
                for n, kept in ((3, 2), (7, 6), (1, 1), (5, 1))]


def eval_fn(state, batch):
    per_token = (batch["x"] - state) ** 2
    return {"loss_sum": (per_token * batch["mask"]).sum(), "tokens": batch["mask"].sum(),
            "batch_loss": (per_token * batch["mask"]).sum() / batch["mask"].sum()}


def test_eval_metrics_are_reduced_over_the_whole_evaluation_set_and_at_start_evaluates_step_0(tmp_path):
    hook = jm.EvalHook(eval_fn, EVAL_BATCHES, every_n_steps=4, output_dir=tmp_path, at_start=True,
                       metrics={"loss": jm.Ratio("loss_sum", "tokens"),
                                "ppl": jm.Ratio("loss_sum", "tokens").then(np.exp)})
    train([hook], last_step=8)
    assert [step for step, _ in hook.history] == [0, 4, 8]
    for step, metrics in hook.history:
        losses = [((b["x"].astype(np.float64) - step) ** 2)[b["mask"] > 0] for b in EVAL_BATCHES]
        total = sum(loss.sum() for loss in losses) / sum(len(loss) for loss in losses)  # Σ loss / Σ tokens
        by_rows = np.average([loss.mean() for loss in losses], weights=[len(b["x"]) for b in EVAL_BATCHES])
        assert metrics["loss"] == pytest.approx(total, rel=1e-6)
        assert metrics["ppl"] == pytest.approx(np.exp(total), rel=1e-6)
        assert metrics["batch_loss"] == pytest.approx(by_rows, rel=1e-6)  # unlisted: weighted by batch size
        assert abs(total - by_rows) > 0.1 * total  # so Σ/Σ is not what weighting batches gives
    assert [s for s, _ in scalars(tmp_path, "eval/loss")] == [0, 4, 8]
    assert hook.trace_count == 4  # one per batch shape


def test_eval_metrics_must_be_reductions():
    with pytest.raises(TypeError, match=r"EvalHook metrics must be \{name: jm.Reduction\}"):
        jm.EvalHook(eval_fn, EVAL_BATCHES, every_n_steps=4, metrics={"loss": "loss_sum"})


# -- a resumed run is the same run ----------------------------------------------------------------


@pytest.mark.parametrize("k", [1, 4])
def test_a_resumed_session_writes_the_uninterrupted_windows_and_schedule(tmp_path, k):
    def hooks(logdir):
        return [jm.SummarySaverHook(save_steps=8, output_dir=logdir, summaries={"ratio": jm.Ratio("loss_sum",
                                                                                                   "tokens")}),
                jm.EvalHook(eval_fn, EVAL_BATCHES, every_n_steps=6, output_dir=logdir, at_end=False),
                jm.CheckpointSaverHook(logdir / "ckpt", save_steps=5)]

    whole = tmp_path / "whole"
    train(hooks(whole), k=k)
    cut = tmp_path / "cut"
    train(hooks(cut), k=k, last_step=13)  # checkpoints 0, 5, 10, 13: windows open at 13
    resumed = hooks(cut)
    train(resumed, k=k, checkpoint_dir=cut / "ckpt")
    assert lines(cut) == [{**line, "wall_time": mine["wall_time"]} for line, mine in zip(lines(whole), lines(cut),
                                                                                        strict=True)]
    assert [step for step, _ in resumed[1].history] == [6, 12, 18, 24, 30]
    assert resumed[2].saved_steps == [15, 20, 25, 30]


def test_a_preempted_run_keeps_the_checkpoint_schedule(tmp_path):
    class PreemptAt(jm.Hook):
        def after_run(self, ctx, values):
            if values.step == 7:
                ctx.session.request_preemption()

    saver = jm.CheckpointSaverHook(tmp_path, save_steps=5)
    train([saver, PreemptAt()])
    assert saver.saved_steps == [0, 5, 7]  # saved at the step boundary where the request came
    saver = jm.CheckpointSaverHook(tmp_path, save_steps=5)
    train([saver], last_step=16)
    assert saver.saved_steps == [10, 15, 16]  # not 12: the schedule is absolute


def test_a_seconds_timer_keeps_how_long_it_waited_across_a_resume(tmp_path):
    clock = FakeClock()

    class Tick(jm.Hook):
        def after_run(self, ctx, values):
            clock.t += 1.0

    evaluations = []
    hook = jm.PeriodicHook(lambda session: evaluations.append(session.step), every_n_secs=4.5, clock=clock)
    train([hook, Tick(), jm.CheckpointSaverHook(tmp_path, save_steps=3)], last_step=6)
    assert evaluations == [6]  # the run starting 5 s after the start, when 4.5 s had passed
    clock.t += 1000.0  # the time between the runs does not count
    hook = jm.PeriodicHook(lambda session: evaluations.append(session.step), every_n_secs=4.5, clock=clock)
    train([hook, Tick()], last_step=12, checkpoint_dir=tmp_path)
    assert evaluations == [6, 11]  # checkpoint 6 had waited 1 s: 3.5 s more, as without the stop


def test_windows_of_other_reductions_in_a_checkpoint_are_dropped_with_a_warning(tmp_path, caplog):
    saver = jm.CheckpointSaverHook(tmp_path / "ckpt", save_steps=5)
    train([jm.SummarySaverHook(save_steps=8, output_dir=tmp_path), saver], last_step=13)
    caplog.set_level(logging.WARNING, logger="jaxmon")
    hook = jm.SummarySaverHook(save_steps=8, output_dir=tmp_path / "other", summaries={"sum": jm.Sum("loss")})
    train([hook], last_step=16, checkpoint_dir=tmp_path / "ckpt")
    assert [r.getMessage() for r in caplog.records if "holds the windows" in r.getMessage()] == [
        "The checkpoint of step 13 holds the windows of other reductions (SummarySaverHook.outputs=Mean(None)); "
        "the hooks' windows start afresh at step 13."]
    assert scalars(tmp_path / "other", "sum") == [(16, sum(range(14, 17)))]  # from the restored step


def test_the_schedule_is_absolute_and_reports_step_1_when_asked():
    from jaxmon._base.triggers import Every

    timer = Every(every_steps=5)
    timer.start(7)  # a run resumed at 7
    assert timer.next_trigger(7) == jm.Trigger(10) and not timer.due(8) and timer.due(10)
    assert timer.next_trigger(10) == jm.Trigger(15) and timer.due(17)  # a run that went past 15
    first = Every(every_steps=5, first=True)
    first.start(0)
    assert first.next_trigger(0) == jm.Trigger(1) and [s for s in range(1, 11) if first.due(s)] == [1, 5, 10]
    clock = FakeClock()
    secs = Every(every_secs=10.0, clock=clock)
    secs.start(0)
    clock.t += 4.0
    state = secs.get_state()
    assert state == {"last_step": 0, "waited": 4.0}
    again = Every(every_secs=10.0, clock=clock)
    again.set_state(state)
    clock.t += 100.0  # between the save and the resume: not counted
    assert again.get_state() == state
    again.start(3)
    assert again.next_trigger(3) == jm.Trigger(time=clock.t + 6.0, clock=clock)


def test_a_restored_timer_that_its_hook_never_started_counts_from_its_restored_step():
    from jaxmon._base.triggers import Every

    clock = FakeClock()
    timer = Every(every_steps=5, clock=clock)
    timer.set_state({"last_step": 10, "waited": None})  # restored; the hook has no after_create_session
    assert not timer.due(12)
    clock.t += 3.0
    assert timer.update_last_triggered_step(15) == (0.0, 5)  # seconds count from the first trigger
    clock.t += 2.0
    assert timer.due(20) and timer.get_state() == {"last_step": 20, "waited": None}


def _tokens(state, batch, outputs):
    return outputs["tokens"]


def test_a_reduction_over_a_callable_is_named_the_same_in_every_process():
    # A checkpoint's windows are matched by these names: a function's address would differ after a restart.
    class Scale:
        def __call__(self, x):
            return 2 * x

    reductions = [jm.Ratio("loss_sum", _tokens).then(np.exp), jm.Mean(_tokens, weight=_tokens), jm.Sum(_tokens),
                  jm.FirstNonFinite(_tokens), jm.Sum(functools.partial(_tokens)).then(Scale())]
    assert [repr(r) for r in reductions] == [
        "Ratio('loss_sum', _tokens).then(exp)", "Mean(_tokens, weight=_tokens)", "Sum(_tokens)",
        "FirstNonFinite(_tokens)",
        "Sum(partial(_tokens)).then(test_a_reduction_over_a_callable_is_named_the_same_in_every_process.<locals>.Scale)"]
