"""When the session asks a hook about its run events (`schedule_of`), and how far a
multi-step run may go before the hook acts (`steps_to`)."""

import math

import pytest
from helpers import FakeClock

import jaxmon as jm
from jaxmon._base.schedule import Schedule, schedule_of, steps_to
from jaxmon._base.triggers import Trigger


class EveryFive(jm.Hook):
    def next_trigger(self, step):
        return Trigger(step=(step // 5 + 1) * 5)

    def after_run(self, ctx, values):
        pass


class ReplacesAfterRun(EveryFive):
    def after_run(self, ctx, values):  # without saying when again: called on every run
        pass


@pytest.mark.parametrize("trigger, step, steps", [
    (None, 3, None),
    (Trigger(step=10), 3, 7),
    (Trigger(step=10), 10, 1),  # due already: a run of one step
    (Trigger(step=10, exact=False), 3, None),  # a later run will do
    (Trigger(time=5.0, clock=FakeClock()), 3, None),  # by time only: no step to end on
    (Trigger(step=math.inf), 3, None),
], ids=["none", "exact", "due", "inexact", "time", "never"])
def test_steps_to_is_how_many_steps_a_run_may_take_before_the_trigger(trigger, step, steps):
    assert steps_to(trigger, step) == steps


def test_a_hook_without_next_trigger_is_called_every_run_and_bounds_no_run():
    assert schedule_of(jm.Hook()) == Schedule(None, None)


def test_a_hook_with_next_trigger_is_asked_it_and_its_runs_end_on_its_steps():
    hook = EveryFive()
    schedule = schedule_of(hook)
    assert schedule.next(3) == Trigger(step=5)
    assert [schedule.cut(step) for step in (0, 3, 5)] == [5, 2, 5]


def test_a_subclass_or_instance_that_replaces_a_run_event_is_called_every_run_but_still_bounds_runs():
    subclass = schedule_of(ReplacesAfterRun())
    assert subclass.next is None and subclass.cut(3) == 2
    hook = EveryFive()
    hook.before_run = lambda ctx: None  # replaced on the instance
    instance = schedule_of(hook)
    assert instance.next is None and instance.cut(3) == 2


def test_a_built_in_timed_hook_is_asked_its_timers_trigger():
    hook = jm.StepCounterHook(every_n_steps=10)
    schedule = schedule_of(hook)
    assert schedule.next is not None and schedule.next(0) == hook.next_trigger(0)
