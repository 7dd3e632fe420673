"""StopAtStepHook end to end: `last_step` and `num_steps` targets, step jumps, argument
checks, and the target across restarts and recoveries."""

import logging

import pytest
from helpers import RecordingHook, count_step, zero

import jaxmon as jm


def run_all(sess):
    values, stops = [], []
    while not sess.should_stop():
        values.append(int(sess.run(fetches="value")))
        stops.append(sess.should_stop())
    return values, stops


def test_last_step_is_inclusive_and_a_restart_continues_to_the_new_last_step():
    sess = jm.MonitoredSession(count_step, zero, hooks=[jm.StopAtStepHook(last_step=3)])
    assert run_all(sess) == ([1, 2, 3], [False, False, True])
    sess.close()
    restarted = jm.MonitoredSession(count_step, state=sess.state, initial_step=sess.step,
                                    hooks=[jm.StopAtStepHook(last_step=5)])
    assert run_all(restarted) == ([4, 5], [False, True])


def test_num_steps_counts_from_the_step_the_session_starts_at():
    sess = jm.MonitoredSession(count_step, zero, hooks=[jm.StopAtStepHook(num_steps=3)])
    assert run_all(sess)[0] == [1, 2, 3]
    hook = jm.StopAtStepHook(num_steps=4)
    restarted = jm.MonitoredSession(count_step, state=sess.state, initial_step=3, hooks=[hook])
    assert run_all(restarted)[0] == [4, 5, 6, 7] and hook.last_step == 7


def stops_at(hook, session_step, steps):
    """Drives the hook directly with the step numbers a session would report."""
    session = jm.MonitoredSession(count_step, zero, initial_step=session_step, hooks=[hook])
    stopped = []
    for step in steps:
        ctx = jm.RunContext(step - 1, session, jm.RunArgs())
        hook.after_run(ctx, jm.RunValues(None, step))
        stopped.append(ctx.stop_requested)
    return stopped


def test_last_step_stops_at_and_past_it():
    assert stops_at(jm.StopAtStepHook(last_step=10), 5, [5, 9, 10, 11]) == [False, False, True, True]


def test_num_steps_target_is_the_start_step_plus_num_steps():
    assert stops_at(jm.StopAtStepHook(num_steps=10), 5, [13, 14, 15, 16]) == [False, False, True, True]


def test_a_step_jump_past_the_target_stops():
    assert stops_at(jm.StopAtStepHook(num_steps=10), 5, [15]) == [True]


def test_arguments_are_validated():
    with pytest.raises(ValueError, match="Only one of num_steps or last_step"):
        jm.StopAtStepHook(num_steps=1, last_step=2)
    with pytest.raises(ValueError, match="One of num_steps or last_step must be specified"):
        jm.StopAtStepHook()
    with pytest.raises(ValueError, match="num_steps must be an int >= 0; got -1"):
        jm.StopAtStepHook(num_steps=-1)


def test_no_step_counter_is_needed_in_the_state():
    def no_counter(state, batch):  # the state is a bare float: no step variable anywhere
        return state * 0.5, {"value": state}

    with jm.MonitoredSession(no_counter, state=1.0, hooks=[jm.StopAtStepHook(num_steps=4)]) as sess:
        while not sess.should_stop():
            sess.run()
    assert sess.step == 4 and float(sess.state) == 1 / 16


@pytest.mark.parametrize("initial_step", [5, 7])
def test_a_session_already_at_or_past_last_step_runs_nothing(initial_step):
    record = RecordingHook()
    sess = jm.MonitoredSession(count_step, zero, initial_step=initial_step,
                               hooks=[jm.StopAtStepHook(last_step=5), record])
    assert sess.should_stop()
    assert run_all(sess) == ([], [])  # a loop on should_stop() makes no run
    with pytest.raises(RuntimeError, match="should_stop"):
        sess.run()
    sess.close()
    assert sess.step == initial_step and int(sess.state) == 0  # no step ran
    assert "before_run" not in record.calls and "after_run" not in record.calls
    assert record.calls["end"] == 1


def train_until(directory, hook, steps=None):
    """A session that checkpoints `directory` every step; runs `steps` runs (None: until
    it stops), then closes (saving its last step). Returns the step it ended at."""
    with jm.MonitoredSession(count_step, zero, hooks=[jm.CheckpointSaverHook(directory, save_steps=1), hook]) as sess:
        for _ in range(10**6 if steps is None else steps):
            if sess.should_stop():
                break
            sess.run()
    return sess.step


def test_a_restart_with_the_same_num_steps_keeps_the_first_runs_target(tmp_path):
    # A job preempted at step 3 of num_steps=6, restarted with the same config, ends at 6, not 9.
    assert train_until(tmp_path, jm.StopAtStepHook(num_steps=6), steps=3) == 3
    hook = jm.StopAtStepHook(num_steps=6)
    assert train_until(tmp_path, hook) == 6 and hook.last_step == 6
    again = jm.StopAtStepHook(num_steps=6)
    assert train_until(tmp_path, again) == 6 and again.last_step == 6  # already there: runs nothing


def test_a_restart_with_another_num_steps_counts_from_the_restored_step_and_says_so(tmp_path, caplog):
    assert train_until(tmp_path, jm.StopAtStepHook(num_steps=6), steps=3) == 3
    hook = jm.StopAtStepHook(num_steps=4)
    with caplog.at_level(logging.INFO, logger="jaxmon"):
        assert train_until(tmp_path, hook) == 7
    assert hook.last_step == 7
    [line] = [r.getMessage() for r in caplog.records if "StopAtStepHook(num_steps=4)" in r.getMessage()]
    assert "restored step 3" in line and "stops at step 7" in line


def test_a_recovery_keeps_the_target_whatever_the_step(tmp_path):
    failures = iter([jm.AbortedError("preempted worker")])

    class FailOnce(jm.Hook):
        def after_run(self, ctx, values):
            if values.step == 4:
                error = next(failures, None)
                if error is not None:
                    raise error

    hook = jm.StopAtStepHook(num_steps=6)
    with jm.MonitoredSession(count_step, zero, hooks=[jm.CheckpointSaverHook(tmp_path, save_steps=2), hook,
                                                      FailOnce()]) as sess:
        while not sess.should_stop():
            sess.run()
    assert sess.step == 6 and hook.last_step == 6
