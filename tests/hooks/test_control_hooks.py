"""Control hooks: NaN checks, feeds, final fetches, step waiter, periodic calls, evaluation,
early stopping, and the per-hook error policy, each in real sessions."""

import logging
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import RecordingHook, RecordingWriter, count_step, float_zero, run_loop, zero

import jaxmon as jm

# -- shared pieces ------------------------------------------------------------------------


def nan_at_3(state, batch):
    """A float counter whose loss is NaN exactly at step 3."""
    state = state + 1.0
    return state, {"loss": jnp.where(state == 3, jnp.nan, state)}


def inf_at_3(state, batch):
    state = state + 1.0
    return state, {"loss": jnp.where(state == 3, jnp.inf, state)}


def vector_nan_at_3(state, batch):
    """A loss of 5 entries; at step 3 the first 2 are NaN."""
    state = state + 1.0
    entries = state * jnp.ones(5)
    return state, {"loss": jnp.where((state == 3) & (jnp.arange(5) < 2), jnp.nan, entries)}


class FakeTime:
    """A clock that only moves when `sleep` is called (or `advance` by hand)."""

    def __init__(self, start=0.0):
        self.now = start
        self.sleeps = []

    def clock(self):
        return self.now

    def sleep(self, secs):
        self.sleeps.append(secs)
        self.now += secs

    def advance(self, secs):
        self.now += secs


# -- NanHook -----------------------------------------------------------------------------------


def test_nan_loss_read_every_step_raises_one_step_late_from_the_run_completing_step_4():
    record = RecordingHook()
    started = []
    nan_hook = jm.NanHook("loss", every_n_steps=1)
    hooks = [nan_hook, record, jm.StopAtStepHook(last_step=10)]
    with pytest.raises(jm.NanLossDuringTrainingError) as info:
        with jm.MonitoredSession(nan_at_3, float_zero, hooks=hooks) as sess:
            run_loop(sess, started)
    err = info.value
    assert isinstance(err, RuntimeError)
    message = str(err)
    assert message.startswith("NaN loss during training")
    assert "step 3" in message and "nan" in message
    assert err.step == 3 and math.isnan(err.value)
    # Read one run late: the run that started at step 3 (and completed step 4) raised it.
    assert started[-1] == 3 and sess.step == 4
    assert "end" not in record.calls
    # Step 3's read is delivered right after step 4's dispatch, before that run's own after_run
    # calls, so the other hooks last saw step 3.
    assert record.calls["after_run"] == 3 and record.values[-1].step == 3
    assert sess.should_stop()
    with pytest.raises(RuntimeError, match="closed session"):
        sess.run()
    notes = getattr(err, "__notes__", [])
    assert any(repr(nan_hook) in note and "after_read" in note and "step 3" in note for note in notes), notes


def test_nan_at_the_last_step_is_raised_when_the_with_block_closes():
    record = RecordingHook()
    with pytest.raises(jm.NanLossDuringTrainingError) as info:
        with jm.MonitoredSession(nan_at_3, float_zero, hooks=[jm.NanHook("loss"), record,
                                                              jm.StopAtStepHook(last_step=3)]) as sess:
            run_loop(sess)
            steps_in_block = sess.step
            stopped_in_block = sess.should_stop()
    assert steps_in_block == 3 and stopped_in_block  # the block itself finished without an error
    assert info.value.step == 3 and "step 3" in str(info.value)
    assert sess.step == 3 and "end" not in record.calls
    with pytest.raises(RuntimeError, match="closed session"):
        sess.run()


def test_sync_right_after_the_nan_step_raises_at_once():
    sess = jm.MonitoredSession(nan_at_3, float_zero, hooks=[jm.NanHook("loss")])
    for _ in range(3):
        sess.run()
    assert sess.step == 3
    with pytest.raises(jm.NanLossDuringTrainingError) as info:
        sess.sync()
    assert info.value.step == 3 and sess.step == 3


def test_nan_without_fail_logs_a_warning_and_stops_after_step_4(caplog):
    record = RecordingHook()
    hooks = [jm.NanHook("loss", fail_on_nan_loss=False, every_n_steps=1), record, jm.StopAtStepHook(last_step=10)]
    with caplog.at_level(logging.WARNING, logger="jaxmon"):
        with jm.MonitoredSession(nan_at_3, float_zero, hooks=hooks) as sess:
            started = []
            run_loop(sess, started)
    assert started == [0, 1, 2, 3] and sess.step == 4
    assert record.calls["end"] == 1  # a clean stop
    warnings = [r for r in caplog.records if r.name == "jaxmon" and r.levelno == logging.WARNING]
    nan_warnings = [r.getMessage() for r in warnings if "NaN loss during training" in r.getMessage()]
    assert len(nan_warnings) == 1 and "step 3" in nan_warnings[0]  # step 4's loss, read at close, is not warned again


def test_nan_without_fail_sets_should_stop_after_the_run_completing_step_4():
    sess = jm.MonitoredSession(nan_at_3, float_zero,
                               hooks=[jm.NanHook("loss", fail_on_nan_loss=False, every_n_steps=1)])
    for _ in range(3):
        sess.run()
    assert not sess.should_stop()  # step 3's loss is not read yet
    sess.run()
    assert sess.should_stop() and sess.step == 4
    sess.close()


def test_infinite_loss_counts_as_non_finite():
    hooks = [jm.NanHook("loss"), jm.StopAtStepHook(last_step=10)]
    with pytest.raises(jm.NanLossDuringTrainingError) as info:
        with jm.MonitoredSession(inf_at_3, float_zero, hooks=hooks) as s:
            run_loop(s)
    assert info.value.step == 3 and "inf" in str(info.value) and math.isinf(info.value.value)


def test_an_array_loss_reports_how_many_entries_are_non_finite():
    sess = jm.MonitoredSession(vector_nan_at_3, float_zero, hooks=[jm.NanHook("loss", every_n_steps=1)])
    for _ in range(3):
        sess.run()
    with pytest.raises(jm.NanLossDuringTrainingError) as info:
        sess.run()
    assert "2 of 5 entries non-finite" in str(info.value) and info.value.step == 3


def test_nan_hook_error_is_logged_at_error_level(caplog):
    sess = jm.MonitoredSession(nan_at_3, float_zero, hooks=[jm.NanHook("loss", every_n_steps=1)])
    with caplog.at_level(logging.ERROR, logger="jaxmon"), pytest.raises(jm.NanLossDuringTrainingError):
        for _ in range(5):
            sess.run()
    assert any(r.levelno == logging.ERROR and "diverged" in r.getMessage() for r in caplog.records)


def test_nan_tensor_hook_is_an_alias():
    assert jm.NanTensorHook is jm.NanHook


def test_nan_hook_on_an_output_name_adds_no_compilation():
    sess = jm.MonitoredSession(nan_at_3, float_zero, hooks=[jm.NanHook("loss", fail_on_nan_loss=False)])
    for _ in range(2):
        sess.run()
    sess.sync()
    assert sess.compile_count == 1 and not sess.should_stop()


def test_nan_hook_with_a_callable_fetch_compiles_once_over_many_runs():
    def doubled_state(state, batch, outputs):
        return state * 2.0

    sess = jm.MonitoredSession(nan_at_3, float_zero, hooks=[jm.NanHook(doubled_state)])
    for _ in range(8):
        sess.run()
    sess.sync()
    assert sess.compile_count == 1 and sess.step == 8 and not sess.should_stop()


def test_nan_hook_with_a_callable_fetch_detects_a_nan():
    def loss_of(state, batch, outputs):
        return outputs["loss"]

    sess = jm.MonitoredSession(nan_at_3, float_zero, hooks=[jm.NanHook(loss_of)])
    for _ in range(3):
        sess.run()
    with pytest.raises(jm.NanLossDuringTrainingError) as info:
        sess.sync()
    assert info.value.step == 3


def test_nan_hook_rejects_a_bad_fetch():
    with pytest.raises(TypeError):
        jm.NanHook(3)


# -- FeedFnHook --------------------------------------------------------------------------------


def x_plus_one(state, batch):
    return state, {"y": batch["x"] + 1}


def test_feed_fn_feeds_every_run_once():
    calls = []

    def feed_fn():
        calls.append(1)
        return {"x": 1.0}

    sess = jm.MonitoredSession(x_plus_one, zero, hooks=[jm.FeedFnHook(feed_fn)])
    y = sess.run(fetches="y")  # a single name gives its value itself
    assert isinstance(y, np.ndarray) and float(y) == 2.0
    assert len(calls) == 1
    outputs = sess.run()
    assert float(outputs["y"]) == 2.0 and len(calls) == 2
    for _ in range(3):
        sess.run()
    assert len(calls) == 5


def test_feed_fn_merges_with_the_callers_batch():
    def add(state, batch):
        return state, {"sum": batch["x"] + batch["z"]}

    sess = jm.MonitoredSession(add, zero, hooks=[jm.FeedFnHook(lambda: {"x": 1.0})])
    total = sess.run({"z": 10.0}, fetches="sum")
    assert isinstance(total, np.ndarray) and float(total) == 11.0


def test_feed_fn_must_be_callable():
    with pytest.raises(TypeError, match="feed_fn"):
        jm.FeedFnHook({"x": 1.0})


def test_a_key_fed_by_the_caller_and_the_feed_fn_is_an_error():
    sess = jm.MonitoredSession(x_plus_one, zero, hooks=[jm.FeedFnHook(lambda: {"x": 1.0})])
    with pytest.raises(RuntimeError, match="'x'"):
        sess.run({"x": 5.0})
    assert sess.step == 0


# -- FinalOpsHook ------------------------------------------------------------------------------


def vector_step(state, batch):
    state = state + 1.0
    return state, {"loss": state.sum()}


def arange3():
    return jnp.arange(3.0)


def sum_of_squares(state, batch, outputs):
    return (state**2).sum()


def times_ten(state, batch, outputs):
    return state * 10.0


def test_final_ops_are_computed_on_the_last_state_and_outputs():
    hook = jm.FinalOpsHook({"scalar": sum_of_squares, "vector": times_ten, "out": "loss"})
    with jm.MonitoredSession(vector_step, arange3, hooks=[hook, jm.StopAtStepHook(last_step=2)]) as sess:
        run_loop(sess)
        assert hook.final_values is None  # not before end
    # After 2 steps the state is [2, 3, 4].
    values = hook.final_values
    assert set(values) == {"scalar", "vector", "out"}
    assert float(values["scalar"]) == 4 + 9 + 16
    np.testing.assert_allclose(values["vector"], [20.0, 30.0, 40.0])
    assert float(values["out"]) == 9.0
    assert hook.final_ops_values is values or hook.final_ops_values == values


def test_final_ops_with_zero_steps_warn_and_stay_none(caplog):
    hook = jm.FinalOpsHook({"scalar": sum_of_squares})
    with caplog.at_level(logging.WARNING, logger="jaxmon"):
        with jm.MonitoredSession(vector_step, arange3, hooks=[hook, jm.StopAtStepHook(last_step=0)]) as sess:
            run_loop(sess)
    assert sess.step == 0 and hook.final_values is None
    assert any("FinalOpsHook" in r.getMessage() and r.levelno == logging.WARNING for r in caplog.records)


def test_final_ops_are_not_computed_on_an_error_exit():
    hook = jm.FinalOpsHook({"scalar": sum_of_squares})
    with pytest.raises(ZeroDivisionError):
        with jm.MonitoredSession(vector_step, arange3, hooks=[hook]) as sess:
            sess.run()
            raise ZeroDivisionError("body failed")
    assert sess.step == 1 and hook.final_values is None


@pytest.mark.parametrize("final_fetches", [None, {}, []], ids=["none", "empty-dict", "empty-list"])
def test_final_ops_need_some_fetches(final_fetches):
    with pytest.raises(ValueError, match="final_fetches"):
        jm.FinalOpsHook(final_fetches)


# -- GlobalStepWaiterHook ----------------------------------------------------------------------


def test_waiter_for_step_zero_starts_without_sleeping():
    fake = FakeTime()
    watched = []

    def watch():
        watched.append(1)
        return 0

    hook = jm.GlobalStepWaiterHook(0, watch=watch, clock=fake.clock, sleep=fake.sleep)
    sess = jm.MonitoredSession(count_step, zero, hooks=[hook])
    sess.run()
    assert fake.sleeps == [] and watched == [] and sess.step == 1


def test_waiter_starts_the_first_run_after_exactly_two_sleeps():
    fake = FakeTime()
    steps = [0, 500, 1100]

    def watch():
        return steps[len(fake.sleeps)]

    seen = []

    class SleepsAtStart(jm.Hook):
        def before_run(self, ctx):
            seen.append(len(fake.sleeps))

    hook = jm.GlobalStepWaiterHook(1000, watch=watch, poll_secs=0.5, clock=fake.clock, sleep=fake.sleep)
    sess = jm.MonitoredSession(count_step, zero, hooks=[hook, SleepsAtStart()])
    sess.run()
    assert seen == [2] and fake.sleeps == [0.5, 0.5] and sess.step == 1
    sess.run()
    sess.run()
    assert len(fake.sleeps) == 2 and seen == [2, 2, 2]  # once started it never waits again


def test_waiter_times_out_naming_the_step():
    fake = FakeTime()
    hook = jm.GlobalStepWaiterHook(1000, watch=lambda: 7, timeout_secs=2, poll_secs=0.5,
                                   clock=fake.clock, sleep=fake.sleep)
    sess = jm.MonitoredSession(count_step, zero, hooks=[hook])
    with pytest.raises(TimeoutError, match="1000") as info:
        sess.run()
    assert "step 7" in str(info.value)
    assert fake.sleeps == [0.5] * 4 and sess.step == 0


def test_waiter_on_its_own_session_below_the_step_fails_suggesting_watch():
    sleeps = []
    hook = jm.GlobalStepWaiterHook(5, sleep=sleeps.append)
    sess = jm.MonitoredSession(count_step, zero, hooks=[hook])
    with pytest.raises(RuntimeError, match="watch=") as info:
        sess.run()
    assert "5" in str(info.value) and sleeps == [] and sess.step == 0


def test_waiter_on_its_own_restored_session_starts_at_once():
    sleeps = []
    hook = jm.GlobalStepWaiterHook(5, sleep=sleeps.append)
    sess = jm.MonitoredSession(count_step, zero, hooks=[hook], initial_step=5)
    sess.run()
    assert sess.step == 6 and sleeps == []


def committed(directory):
    """A step directory as Orbax leaves a complete one: with its commit marker."""
    directory.mkdir()
    (directory / "commit_success.txt").write_text("")


def test_latest_checkpoint_step_ignores_unfinished_checkpoints_and_files(tmp_path):
    committed(tmp_path / "100")
    committed(tmp_path / "200")
    (tmp_path / "300.orbax-checkpoint-tmp-1").mkdir()
    (tmp_path / "400").write_text("a file, not a checkpoint")
    (tmp_path / "500").mkdir()  # empty: not a checkpoint either
    assert jm.latest_checkpoint_step(tmp_path) == 200
    assert jm.latest_checkpoint_step(str(tmp_path)) == 200
    assert jm.latest_checkpoint_step(tmp_path / "missing") is None
    (tmp_path / "empty").mkdir()
    assert jm.latest_checkpoint_step(tmp_path / "empty") is None


def test_waiter_on_a_checkpoint_directory(tmp_path):
    committed(tmp_path / "100")
    committed(tmp_path / "200")
    (tmp_path / "300.orbax-checkpoint-tmp-1").mkdir()
    fake = FakeTime()
    hook = jm.GlobalStepWaiterHook(150, watch=tmp_path, clock=fake.clock, sleep=fake.sleep)
    sess = jm.MonitoredSession(count_step, zero, hooks=[hook])
    sess.run()
    assert fake.sleeps == [] and sess.step == 1

    # An unfinished checkpoint at 300 does not count.
    late = jm.GlobalStepWaiterHook(300, watch=tmp_path, timeout_secs=1, poll_secs=0.5,
                                   clock=fake.clock, sleep=fake.sleep)
    with pytest.raises(TimeoutError, match="300"):
        jm.MonitoredSession(count_step, zero, hooks=[late]).run()


def test_waiter_on_a_missing_directory_keeps_waiting(tmp_path):
    fake = FakeTime()
    hook = jm.GlobalStepWaiterHook(1, watch=tmp_path / "missing", timeout_secs=1, poll_secs=0.5,
                                   clock=fake.clock, sleep=fake.sleep)
    with pytest.raises(TimeoutError, match="None"):
        jm.MonitoredSession(count_step, zero, hooks=[hook]).run()
    assert len(fake.sleeps) == 2


@pytest.mark.parametrize("kwargs, error", [
    ({"wait_until_step": 1.5}, ValueError),
    ({"wait_until_step": 5, "watch": 3}, TypeError),
    ({"wait_until_step": 5, "timeout_secs": -1}, ValueError),
    ({"wait_until_step": 5, "poll_secs": -1}, ValueError),
])
def test_waiter_validates_its_arguments(kwargs, error):
    with pytest.raises(error):
        jm.GlobalStepWaiterHook(**kwargs)


# -- PeriodicHook ------------------------------------------------------------------------------


def test_periodic_every_3_steps_calls_after_steps_3_6_9():
    calls, sessions = [], []

    def fn(session):
        calls.append(session.step)
        sessions.append(session)

    sess = jm.MonitoredSession(count_step, zero, hooks=[jm.PeriodicHook(fn, every_n_steps=3)])
    for _ in range(10):
        sess.run()
    sess.close()
    assert calls == [3, 6, 9] and all(s is sess for s in sessions)  # after steps N, 2N, ...


@pytest.mark.parametrize("runs, expected", [(9, [3, 6, 9]), (10, [3, 6, 9, 10])])
def test_periodic_at_end_calls_once_more_unless_the_last_step_was_just_called(runs, expected):
    calls = []
    sess = jm.MonitoredSession(count_step, zero, hooks=[
        jm.PeriodicHook(lambda s: calls.append(s.step), every_n_steps=3, at_end=True)])
    for _ in range(runs):
        sess.run()
    sess.close()
    assert calls == expected


def test_periodic_without_at_end_does_not_call_at_end():
    calls = []
    sess = jm.MonitoredSession(count_step, zero, hooks=[jm.PeriodicHook(lambda s: calls.append(s.step), 3)])
    for _ in range(11):
        sess.run()
    sess.close()
    assert calls == [3, 6, 9]


def test_periodic_every_n_secs_with_a_fake_clock():
    fake = FakeTime()
    calls = []
    hook = jm.PeriodicHook(lambda s: calls.append(s.step), every_n_secs=2.0, clock=fake.clock)
    sess = jm.MonitoredSession(count_step, zero, hooks=[hook])
    for _ in range(10):
        fake.advance(1.0)
        sess.run()
    assert calls == [2, 4, 6, 8, 10]  # 2 s after the session's start, then after each call


@pytest.mark.parametrize("args, kwargs, error", [
    ((print,), {}, ValueError),  # neither period
    ((print,), {"every_n_steps": 2, "every_n_secs": 1.0}, ValueError),  # both
    (("not a function",), {"every_n_steps": 2}, TypeError),
    ((print,), {"every_n_steps": 2, "on_error": "bogus"}, ValueError),
    ((print,), {"every_n_steps": 0}, ValueError),
])
def test_periodic_validates_its_arguments(args, kwargs, error):
    with pytest.raises(error):
        jm.PeriodicHook(*args, **kwargs)


# -- EvalHook ----------------------------------------------------------------------------------


def scaled(state, batch):
    return {"loss": (state * batch["x"]).mean(), "acc": batch["x"].mean()}


def float_count(state, batch):
    state = state + 1.0
    return state, {"value": state}


EQUAL_BATCHES = [{"x": np.ones((4,), np.float32) * k} for k in (1, 2, 3)]


def test_eval_every_5_steps_and_at_end_with_weighted_means_and_summaries(caplog):
    writer = RecordingWriter()
    hook = jm.EvalHook(scaled, EQUAL_BATCHES, every_n_steps=5, summary_writer=writer)
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

    hook = jm.EvalHook(scaled, EQUAL_BATCHES, every_n_steps=5)
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
    hook = jm.EvalHook(scaled, EQUAL_BATCHES, every_n_steps=5)
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
    hook = jm.EvalHook(scaled, batches, every_n_steps=3, at_end=False)
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

    hook = jm.EvalHook(scaled, data, every_n_steps=2, at_end=False)
    sess = jm.MonitoredSession(float_count, float_zero, hooks=[hook])
    for _ in range(4):
        sess.run()
    assert [step for step, _ in hook.history] == [2, 4] and len(made) == 2
    assert hook.history[1][1]["loss"] == pytest.approx(8.0)


@pytest.mark.parametrize("make", [lambda: iter(EQUAL_BATCHES), lambda: (b for b in EQUAL_BATCHES)],
                         ids=["iterator", "generator"])
def test_eval_data_read_only_once_is_rejected(make):
    with pytest.raises(ValueError, match="re-iterable"):
        jm.EvalHook(scaled, make(), every_n_steps=5)


def test_eval_on_empty_data_fails_at_evaluation():
    hook = jm.EvalHook(scaled, [], every_n_steps=2)
    sess = jm.MonitoredSession(float_count, float_zero, hooks=[hook])
    sess.run()
    with pytest.raises(ValueError, match="no batches"):
        sess.run()
    assert hook.history == []


def test_eval_needs_a_period_or_at_end():
    with pytest.raises(ValueError, match="every_n_steps"):
        jm.EvalHook(scaled, EQUAL_BATCHES, at_end=False)


def test_eval_only_at_end():
    hook = jm.EvalHook(scaled, EQUAL_BATCHES)
    with jm.MonitoredSession(float_count, float_zero, hooks=[hook]) as sess:
        for _ in range(4):
            sess.run()
        assert hook.history == []
    assert hook.history == [(4, {"loss": pytest.approx(8.0), "acc": pytest.approx(2.0)})]


def test_eval_can_be_called_directly():
    hook = jm.EvalHook(scaled, EQUAL_BATCHES, every_n_steps=100, at_end=False)
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
        jm.EvalHook(scaled, EQUAL_BATCHES, every_n_steps=5, summary_writer=object())


# -- EarlyStoppingHook -------------------------------------------------------------------------


def table_eval(values):
    """An eval_fn whose "loss" (and "acc") at step s is values[s]; the state is an int counter."""
    table = jnp.asarray(values, jnp.float32)

    def eval_fn(state, batch):
        return {"loss": table[state], "acc": table[state]}

    return eval_fn


ONE_BATCH = [{"x": np.ones((2,), np.float32)}]


def early_session(eval_values, last_step=20, **stop_kwargs):
    source = jm.EvalHook(table_eval(eval_values), ONE_BATCH, every_n_steps=1)
    stop = jm.EarlyStoppingHook(stop_kwargs.pop("fetch", "loss"), source=source, **stop_kwargs)
    sess = jm.MonitoredSession(count_step, zero, hooks=[source, stop, jm.StopAtStepHook(last_step=last_step)])
    return source, stop, sess


def test_early_stopping_on_eval_loss_stops_after_patience_checks_without_improvement():
    #            step: 0   1    2    3    4    5    6    7    8    ...
    values = [9.0, 5.0, 3.0, 2.0, 2.5, 2.0, 1.0, 0.5, 0.1] + [0.0] * 20
    source, stop, sess = early_session(values, patience=2)
    with sess:
        run_loop(sess)
        assert sess.should_stop()
    assert sess.step == 5 and stop.stopped_step == 5
    assert stop.best == 2.0 and stop.best_step == 3
    assert [step for step, _ in source.history] == [1, 2, 3, 4, 5]  # no extra eval at the end


def test_early_stopping_mode_max():
    values = [0.0, 0.5, 0.7, 0.8, 0.75, 0.8, 0.9] + [1.0] * 20
    _, stop, sess = early_session(values, fetch="acc", mode="max", patience=2)
    with sess:
        run_loop(sess)
    assert sess.step == 5 and stop.stopped_step == 5 and stop.best == pytest.approx(0.8) and stop.best_step == 3


def test_early_stopping_improvements_smaller_than_min_delta_do_not_count():
    values = [9.0, 5.0, 4.95, 4.92, 4.0] + [0.0] * 20
    _, stop, sess = early_session(values, patience=2, min_delta=0.1)
    with sess:
        run_loop(sess)
    assert sess.step == 3 and stop.stopped_step == 3 and stop.best == 5.0 and stop.best_step == 1

    _, stop, sess = early_session(values, last_step=4, patience=2, min_delta=0.0)
    with sess:
        run_loop(sess)
    assert stop.stopped_step is None and stop.best == 4.0 and stop.best_step == 4


def test_early_stopping_on_a_train_output_every_2_steps():
    #        step: 0    1    2    3    4    5    6    7    8
    table = jnp.asarray([9.0, 0.0, 5.0, 0.0, 3.0, 0.0, 4.0, 0.0, 3.5] + [0.0] * 20, jnp.float32)

    def step_fn(state, batch):
        state = state + 1
        return state, {"loss": table[state]}

    stop = jm.EarlyStoppingHook("loss", patience=2, every_n_steps=2)
    with jm.MonitoredSession(step_fn, zero, hooks=[stop, jm.StopAtStepHook(last_step=20)]) as sess:
        run_loop(sess)
    # Checked after steps 2, 4, 6, 8: 5, 3 (best), 4, 3.5 -> two checks without improvement.
    assert sess.step == 8 and stop.stopped_step == 8
    assert stop.best == 3.0 and stop.best_step == 4
    assert sess.compile_count == 1


@pytest.mark.parametrize("kwargs, error", [
    ({"mode": "avg"}, ValueError),
    ({"patience": -1}, ValueError),
    ({"source": object()}, TypeError),
    ({"source": "eval"}, TypeError),
])
def test_early_stopping_validates_its_arguments(kwargs, error):
    with pytest.raises(error):
        jm.EarlyStoppingHook("loss", **kwargs)


def test_early_stopping_with_a_source_takes_no_period_of_its_own():
    source = jm.EvalHook(scaled, EQUAL_BATCHES, every_n_steps=5)
    with pytest.raises(ValueError, match="every_n_steps"):
        jm.EarlyStoppingHook("loss", source=source, every_n_steps=5)
    with pytest.raises(ValueError):
        jm.EarlyStoppingHook("loss", source=source, every_n_secs=5.0)


def test_early_stopping_on_a_metric_the_source_does_not_report():
    source = jm.EvalHook(scaled, EQUAL_BATCHES, every_n_steps=1)
    stop = jm.EarlyStoppingHook("val_loss", source=source)
    sess = jm.MonitoredSession(float_count, float_zero, hooks=[source, stop])
    with pytest.raises(ValueError, match="val_loss") as info:
        sess.run()
    assert "['acc', 'loss']" in str(info.value)


# -- per-hook error policy ---------------------------------------------------------------------


class FailingAfterRun(jm.Hook):
    def __init__(self, on_error="warn"):
        self.on_error = on_error
        self.failures = 0

    def after_run(self, ctx, values):
        self.failures += 1
        raise ValueError(f"broken at {values.step}")


def hook_warnings(caplog, hook):
    return [r for r in caplog.records if r.name == "jaxmon" and r.levelno == logging.WARNING
            and repr(hook) in r.getMessage()]


def test_a_warn_hook_failing_in_after_run_lets_training_go_on(caplog):
    hook = FailingAfterRun()
    record = RecordingHook()
    with caplog.at_level(logging.WARNING, logger="jaxmon"):
        with jm.MonitoredSession(count_step, zero, hooks=[hook, record]) as sess:
            for _ in range(5):
                sess.run()
    assert sess.step == 5 and hook.failures == 5
    assert record.calls["after_run"] == 5 and record.calls["end"] == 1
    warnings = hook_warnings(caplog, hook)
    assert warnings and "after_run" in warnings[0].getMessage() and "step 1" in warnings[0].getMessage()


def test_warnings_of_a_failing_warn_hook_are_rate_limited(caplog):
    hook = FailingAfterRun()
    with caplog.at_level(logging.WARNING, logger="jaxmon"):
        sess = jm.MonitoredSession(count_step, zero, hooks=[hook])
        for _ in range(50):
            sess.run()
    assert hook.failures == 50 and sess.step == 50
    assert 1 <= len(hook_warnings(caplog, hook)) <= 5


def test_a_raise_hook_failing_in_after_run_stops_with_a_note():
    hook = FailingAfterRun(on_error="raise")
    with pytest.raises(ValueError, match="broken at 1") as info:
        with jm.MonitoredSession(count_step, zero, hooks=[hook]) as sess:
            run_loop(sess)
    assert f"(raised in {hook!r}.after_run at step 1)" in getattr(info.value, "__notes__", [])
    assert sess.step == 1


def test_the_default_policy_is_raise():
    assert jm.Hook.on_error == "raise" and FailingAfterRun("raise").on_error == "raise"


def test_a_bogus_policy_is_rejected_when_the_session_is_built():
    class Bogus(jm.Hook):
        on_error = "bogus"

    with pytest.raises(ValueError, match="bogus"):
        jm.MonitoredSession(count_step, zero, hooks=[Bogus()])


def test_a_warn_hook_failing_in_before_run_sits_that_run_out(caplog):
    class FlakyBefore(jm.Hook):
        on_error = "warn"

        def __init__(self):
            self.after = []

        def before_run(self, ctx):
            if ctx.step == 1:
                raise RuntimeError("flaky")
            return jm.RunArgs(fetches="value")

        def after_run(self, ctx, values):
            self.after.append((values.step, int(values.results)))

    hook = FlakyBefore()
    with caplog.at_level(logging.WARNING, logger="jaxmon"):
        sess = jm.MonitoredSession(count_step, zero, hooks=[hook])
        for _ in range(4):
            sess.run()
    assert sess.step == 4 and hook.after == [(1, 1), (3, 3), (4, 4)]
    assert any("before_run" in r.getMessage() and "step 1" in r.getMessage() for r in hook_warnings(caplog, hook))


def test_a_periodic_hook_with_warn_policy_keeps_training(caplog):
    def fn(session):
        raise OSError("disk full")

    hook = jm.PeriodicHook(fn, every_n_steps=2, on_error="warn")
    with caplog.at_level(logging.WARNING, logger="jaxmon"):
        with jm.MonitoredSession(count_step, zero, hooks=[hook, jm.StopAtStepHook(last_step=6)]) as sess:
            run_loop(sess)
    assert sess.step == 6 and len(hook_warnings(caplog, hook)) == 3


def test_stop_iteration_from_a_warn_hook_still_ends_the_session_cleanly():
    class Ender(jm.Hook):
        on_error = "warn"

        def after_run(self, ctx, values):
            if values.step == 3:
                raise StopIteration

    record = RecordingHook()
    with jm.MonitoredSession(count_step, zero, hooks=[Ender(), record]) as sess:
        for _ in range(10):
            sess.run()
    assert sess.step == 3 and sess.should_stop() and record.calls["end"] == 1
