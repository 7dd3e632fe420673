"""NanHook: a non-finite loss raised (one step late, or at once on a sync) or logged with a
stop, on an output name or a callable fetch, without extra compilations."""

import logging
import math

import jax.numpy as jnp
import pytest
from helpers import RecordingHook, float_zero, run_loop

import jaxmon as jm


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
