"""When the session calls a hook's run events: its `next_trigger` (`Schedule`), and how
far a multi-step run may go before the hook must act (`steps_to`)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

from jaxmon._base.hook import Hook
from jaxmon._base.triggers import Trigger

_RUN_EVENTS = {"before_run", "after_run"}


class Schedule(NamedTuple):
    """How the session asks one hook when it acts.

    Attributes:
      next: `next(step) -> Trigger | None`, asked after the run that ended at `step`;
        None when the hook is called on every run.
      cut: `cut(step) -> int | None`: how many steps from `step` a multi-step run must
        end, so that the hook acts on its exact step; None for no bound.
    """

    next: Callable[[int], Trigger | None] | None
    cut: Callable[[int], int | None] | None


def schedule_of(hook: Hook) -> Schedule:
    """The schedule of `hook`: its own `next_trigger` (a hook without one is called on
    every run, and puts no bound on a run's length)."""
    owner = _defining_class(hook, "next_trigger")
    if owner is Hook:
        return Schedule(None, None)
    asked = hook.next_trigger
    return Schedule(asked if _trusted(hook, owner) else None, lambda step: steps_to(asked(step), step))


def steps_to(trigger: Trigger | None, step: int) -> int | None:
    """How many steps from `step` a multi-step run must end for `trigger` (None: any will do)."""
    if trigger is None or not trigger.exact or trigger.step == math.inf:
        return None
    return max(1, int(trigger.step) - step)


def _defining_class(hook: Any, name: str) -> type:
    return next(cls for cls in type(hook).__mro__ if name in vars(cls))


def _trusted(hook: Any, owner: type) -> bool:
    """Whether `owner`'s schedule speaks for the hook's run events: no subclass of it
    (nor the instance) replaced them, else the hook is called on every run."""
    if _RUN_EVENTS & set(vars(hook)):
        return False
    for cls in type(hook).__mro__:
        if cls is owner:
            return True
        if _RUN_EVENTS & set(vars(cls)):
            return False
    return False
