"""TimedHook: its timer's last trigger saved with each checkpoint and restored from it."""

from helpers import FakeClock

import jaxmon as jm
from jaxmon._base.timed import TimedHook


class EveryThree(TimedHook):
    def __init__(self, clock=None):
        self.timer = jm.SecondOrStepTimer(every_steps=3, clock=clock or FakeClock())


def test_the_state_is_the_timers_last_trigger():
    hook = EveryThree()
    assert hook.get_state() == {"timer": {"last_step": None}}
    hook.timer.update_last_triggered_step(6)
    assert hook.get_state() == {"timer": {"last_step": 6}}


def test_a_restored_hook_goes_on_from_the_saved_trigger():
    saved = EveryThree()
    saved.timer.update_last_triggered_step(6)
    restored = EveryThree()
    restored.set_state(saved.get_state())
    assert restored.timer.last_triggered_step() == 6
    assert [step for step in (7, 8, 9) if restored.timer.should_trigger_for_step(step)] == [9]


def test_a_state_without_a_timer_leaves_the_timer_alone():
    hook = EveryThree()
    hook.timer.update_last_triggered_step(4)
    hook.set_state({})
    assert hook.timer.last_triggered_step() == 4


def test_the_built_in_hooks_save_their_timers_too():
    hook = jm.StepCounterHook(every_n_steps=10)
    assert isinstance(hook, TimedHook) and set(hook.get_state()) >= {"timer"}
