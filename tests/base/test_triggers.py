"""The shared interval timer (SecondOrStepTimer): its arguments, when it triggers by seconds or
steps, and what it records, with a fake clock."""

import pytest
from helpers import FakeClock

import jaxmon as jm
from jaxmon._base.triggers import Every


def test_exactly_one_of_secs_and_steps():
    with pytest.raises(ValueError, match="Can not provide both every_secs and every_steps"):
        jm.SecondOrStepTimer(every_secs=2.0, every_steps=10)
    with pytest.raises(ValueError, match="Either every_secs or every_steps should be provided"):
        jm.SecondOrStepTimer()
    with pytest.raises(ValueError, match="every_steps must be an int >= 1; got 0"):
        jm.SecondOrStepTimer(every_steps=0)
    with pytest.raises(ValueError, match="every_secs must be a number >= 0; got -1"):
        jm.SecondOrStepTimer(every_secs=-1)


def test_every_secs_triggers_once_time_has_passed_and_never_twice_for_a_step():
    clock = FakeClock()
    timer = jm.SecondOrStepTimer(every_secs=1.0, clock=clock)
    assert timer.should_trigger_for_step(1)
    timer.update_last_triggered_step(1)
    assert not timer.should_trigger_for_step(1) and not timer.should_trigger_for_step(2)
    clock.t += 1.0
    assert not timer.should_trigger_for_step(1)
    assert timer.should_trigger_for_step(2)


def test_every_steps_triggers_at_the_interval():
    timer = jm.SecondOrStepTimer(every_steps=3)
    assert timer.should_trigger_for_step(1)
    timer.update_last_triggered_step(1)
    assert [timer.should_trigger_for_step(s) for s in (1, 2, 3, 4)] == [False, False, False, True]


def test_update_returns_elapsed_seconds_and_steps():
    clock = FakeClock()
    timer = jm.SecondOrStepTimer(every_steps=1, clock=clock)
    assert timer.update_last_triggered_step(1) == (None, None)
    clock.t += 0.5
    assert timer.update_last_triggered_step(5) == (0.5, 4)
    clock.t += 0.25
    assert timer.update_last_triggered_step(7) == (0.25, 2)
    assert timer.last_triggered_step() == 7


def test_asking_does_not_record_and_reset_forgets():
    timer = jm.SecondOrStepTimer(every_steps=5)
    assert timer.should_trigger_for_step(3) and timer.should_trigger_for_step(3)
    assert timer.last_triggered_step() is None
    timer.update_last_triggered_step(3)
    timer.reset()
    assert timer.last_triggered_step() is None and timer.should_trigger_for_step(4)


def test_step_jumps_fire_once_at_the_first_step_past_the_interval():
    timer = jm.SecondOrStepTimer(every_steps=8)
    fired = []
    for step in (1, 33, 65, 70, 73, 100):  # 32 steps per dispatch, then a jump
        if timer.should_trigger_for_step(step):
            timer.update_last_triggered_step(step)
            fired.append(step)
    assert fired == [1, 33, 65, 73, 100]


def test_the_never_trigger_timer_never_fires():
    timer = jm.NeverTriggerTimer()
    assert not any(timer.should_trigger_for_step(s) for s in range(5))
    assert timer.update_last_triggered_step(3) == (None, None) and timer.last_triggered_step() is None


@pytest.mark.parametrize(("every", "first_run_steps", "opening"), [
    ({"every_steps": 10}, 1, True),  # the record after step 1 leaves the window open: the next covers 1..10
    ({"every_steps": 10}, 4, True),  # several steps per run: the first run's record
    ({"every_steps": 4}, 4, False),  # the first run reaches a regular trigger: a window ends there
    ({"every_steps": 1}, 1, False),
    ({"every_secs": 30.0}, 1, True),
])
def test_the_first_record_of_a_session_from_step_0_is_an_opening_unless_it_is_a_regular_one(
        every, first_run_steps, opening):
    timer = Every(**every, first=True, clock=FakeClock())
    timer.start(0)
    assert timer.should_trigger_for_step(first_run_steps)
    assert timer.opening(first_run_steps) is opening
    timer.update_last_triggered_step(first_run_steps)
    assert not timer.opening(first_run_steps + 10)  # only the first


def test_a_resumed_session_and_a_timer_without_first_have_no_opening():
    resumed = Every(every_steps=10, first=True)
    resumed.start(25)
    plain = Every(every_steps=10)
    plain.start(0)
    assert not resumed.opening(26) and not plain.opening(1)


def test_timer_fires_once_per_interval_when_steps_jump():
    timer = jm.SecondOrStepTimer(every_steps=10)
    fired = []
    for step in (5, 10, 15, 20, 25):
        if timer.should_trigger_for_step(step):
            timer.update_last_triggered_step(step)
            fired.append(step)
    assert fired == [5, 15, 25]
