"""GlobalStepWaiterHook and latest_checkpoint_step: waiting for a step of the session or of
a checkpoint directory, with a fake clock and sleep."""

import pytest
from helpers import FakeTime, count_step, zero

import jaxmon as jm


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
