"""EvalHook: evaluations every N steps and at the end, their weighted means, and where
their summaries are written."""

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import EQUAL_BATCHES, RecordingWriter, float_count, float_zero, run_loop, scaled_eval

import jaxmon as jm


def test_eval_every_5_steps_and_at_end_with_weighted_means_and_summaries(caplog):
    writer = RecordingWriter()
    hook = jm.EvalHook(scaled_eval, EQUAL_BATCHES, every_n_steps=5, summary_writer=writer)
    with caplog.at_level(logging.INFO, logger="jaxmon"):
        with jm.MonitoredSession(float_count, float_zero, hooks=[hook, jm.StopAtStepHook(last_step=12)]) as sess:
            run_loop(sess)
    assert [step for step, _ in hook.history] == [5, 10, 12]
    # At step s the state is s: batch losses s*1, s*2, s*3 (equal sizes) -> mean 2s; acc = mean(1, 2, 3).
    for step, metrics in hook.history:
        assert metrics["loss"] == pytest.approx(2.0 * step) and metrics["acc"] == pytest.approx(2.0)
        assert isinstance(metrics["loss"], float)
    assert hook.latest == hook.history[-1][1]
    assert hook.trace_count == 1
    assert [step for step, _ in writer.scalars] == [5, 10, 12]
    assert writer.scalars[0][1] == {"eval/loss": pytest.approx(10.0), "eval/acc": pytest.approx(2.0)}
    assert writer.flushes >= 1 and writer.closes == 0  # a given writer is flushed, never closed
    messages = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO and r.name == "jaxmon"]
    assert any(m.startswith("eval at step 5: ") and "loss = 10" in m and "acc = 2" in m for m in messages)


def test_eval_in_a_training_session_without_a_writer_writes_where_the_session_writes(tmp_path):
    """No output_dir: the evaluation's summaries go to the session's summary directory,
    both metrics.jsonl and the TensorBoard event file, with the training's own."""
    import json

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    hook = jm.EvalHook(scaled_eval, EQUAL_BATCHES, every_n_steps=5)
    with jm.MonitoredTrainingSession(float_count, float_zero, checkpoint_dir=tmp_path, save_summaries_steps=5,
                                     hooks=[hook, jm.StopAtStepHook(last_step=10)]) as sess:
        run_loop(sess)
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    evals = {record["step"]: record["eval/loss"] for record in records if "eval/loss" in record}
    assert evals == {5: pytest.approx(10.0), 10: pytest.approx(20.0)}
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("eval/loss")] == [(5, 10.0), (10, 20.0)]
    assert "value" in {tag.split("/")[0] for tag in events.Tags()["scalars"]}  # the session's own summaries


def test_eval_in_a_training_session_not_the_chief_writes_nothing(tmp_path):
    hook = jm.EvalHook(scaled_eval, EQUAL_BATCHES, every_n_steps=5)
    with jm.MonitoredTrainingSession(float_count, float_zero, checkpoint_dir=tmp_path, is_chief=False,
                                     hooks=[hook, jm.StopAtStepHook(last_step=5)]) as sess:
        run_loop(sess)
    assert [step for step, _ in hook.history] == [5]
    assert not list(tmp_path.glob("events.out.tfevents.*")) and not (tmp_path / "metrics.jsonl").exists()


def test_an_eval_fn_with_a_carry_over_three_batches_equals_the_whole_split_in_one():
    """A recurrent evaluation (TF's PTB: the LSTM state fed from one batch to the next):
    the split in 3 batches with the carry gives the result of the split as one batch."""
    def recurrent(state, batch, h):
        def cell(h, x):
            h = 0.5 * h + state * x
            return h, h

        h, hs = jax.lax.scan(cell, h, batch["x"])
        return {"cost": jnp.sum(hs), "iters": jnp.float32(batch["x"].shape[0])}, h

    split = np.arange(1.0, 13.0, dtype=np.float32)
    per_step = {"per_step": jm.Ratio("cost", "iters")}
    hooks = [jm.EvalHook(recurrent, data, metrics=per_step, carry=jnp.float32(0.0), at_end=True)
             for data in ([{"x": part} for part in np.split(split, 3)], [{"x": split}])]
    with jm.MonitoredSession(float_count, float_zero, hooks=[*hooks, jm.StopAtStepHook(last_step=2)]) as sess:
        run_loop(sess)
    three, whole = (hook.latest["per_step"] for hook in hooks)
    assert three == pytest.approx(whole, rel=1e-6) and whole > 0
    reset = jm.EvalHook(lambda state, batch: recurrent(state, batch, jnp.float32(0.0))[0],
                        [{"x": part} for part in np.split(split, 3)], metrics=per_step, at_end=True)
    with jm.MonitoredSession(float_count, float_zero, hooks=[reset, jm.StopAtStepHook(last_step=2)]) as sess:
        run_loop(sess)
    assert reset.latest["per_step"] < whole  # without the carry each batch starts again from 0


def test_eval_reports_the_parts_a_metric_reads_only_when_asked_for():
    def sums(state, batch):
        return {"loss_sum": jnp.sum(batch["x"]), "tokens": jnp.float32(batch["x"].size), "mean": batch["x"].mean()}

    ratio = jm.EvalHook(sums, EQUAL_BATCHES, metrics={"loss": jm.Ratio("loss_sum", "tokens")}, at_end=True)
    asked = jm.EvalHook(sums, EQUAL_BATCHES, metrics={"loss": jm.Ratio("loss_sum", "tokens"),
                                                      "tokens": jm.Sum("tokens")}, at_end=True)
    with jm.MonitoredSession(float_count, float_zero, hooks=[ratio, asked, jm.StopAtStepHook(last_step=1)]) as sess:
        run_loop(sess)
    assert ratio.latest == {"loss": pytest.approx(2.0), "mean": pytest.approx(2.0)}  # no mean of sums
    assert asked.latest == {"loss": pytest.approx(2.0), "mean": pytest.approx(2.0), "tokens": 12.0}


def test_eval_weights_batches_by_their_size():
    batches = [{"x": np.ones((4,), np.float32) * 1}, {"x": np.ones((2,), np.float32) * 4}]
    hook = jm.EvalHook(scaled_eval, batches, every_n_steps=3, at_end=False)
    sess = jm.MonitoredSession(float_count, float_zero, hooks=[hook])
    for _ in range(3):
        sess.run()
    # Batch losses 3*1 (4 rows) and 3*4 (2 rows): (4*3 + 2*12) / 6 = 6, not the unweighted 7.5.
    assert hook.history == [(3, {"loss": pytest.approx(6.0), "acc": pytest.approx(2.0)})]


def test_eval_data_can_be_a_function_returning_a_fresh_generator():
    made = []

    def data():
        made.append(1)
        return (batch for batch in EQUAL_BATCHES)

    hook = jm.EvalHook(scaled_eval, data, every_n_steps=2, at_end=False)
    sess = jm.MonitoredSession(float_count, float_zero, hooks=[hook])
    for _ in range(4):
        sess.run()
    assert [step for step, _ in hook.history] == [2, 4] and len(made) == 2
    assert hook.history[1][1]["loss"] == pytest.approx(8.0)


@pytest.mark.parametrize("make", [lambda: iter(EQUAL_BATCHES), lambda: (b for b in EQUAL_BATCHES)],
                         ids=["iterator", "generator"])
def test_eval_data_read_only_once_is_rejected(make):
    with pytest.raises(ValueError, match="re-iterable"):
        jm.EvalHook(scaled_eval, make(), every_n_steps=5)


def test_eval_on_empty_data_fails_at_evaluation():
    hook = jm.EvalHook(scaled_eval, [], every_n_steps=2)
    sess = jm.MonitoredSession(float_count, float_zero, hooks=[hook])
    sess.run()
    with pytest.raises(ValueError, match="no batches"):
        sess.run()
    assert hook.history == []


def test_eval_needs_a_period_or_at_end():
    with pytest.raises(ValueError, match="every_n_steps"):
        jm.EvalHook(scaled_eval, EQUAL_BATCHES, at_end=False)


def test_eval_only_at_end():
    hook = jm.EvalHook(scaled_eval, EQUAL_BATCHES)
    with jm.MonitoredSession(float_count, float_zero, hooks=[hook]) as sess:
        for _ in range(4):
            sess.run()
        assert hook.history == []
    assert hook.history == [(4, {"loss": pytest.approx(8.0), "acc": pytest.approx(2.0)})]


def test_eval_can_be_called_directly():
    hook = jm.EvalHook(scaled_eval, EQUAL_BATCHES, every_n_steps=100, at_end=False)
    sess = jm.MonitoredSession(float_count, float_zero, hooks=[hook])
    for _ in range(3):
        sess.run()
    assert hook.history == [] and hook.latest is None
    means = hook.evaluate(sess)
    assert means == {"loss": pytest.approx(6.0), "acc": pytest.approx(2.0)}
    assert hook.history == [(3, means)] and hook.latest == means


def test_eval_rejects_a_non_callable_eval_fn_and_a_bad_writer():
    with pytest.raises(TypeError, match="eval_fn"):
        jm.EvalHook("loss", EQUAL_BATCHES, every_n_steps=5)
    with pytest.raises(TypeError, match="summary_writer"):
        jm.EvalHook(scaled_eval, EQUAL_BATCHES, every_n_steps=5, summary_writer=object())
