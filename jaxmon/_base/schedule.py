"""When the session calls a hook's run events: its `next_trigger`, or, for a hook written
against the older members (`timer`, `idle_between_triggers`, `steps_to_next_trigger`),
the same answer read from those (deprecated)."""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from functools import partial
from typing import Any, NamedTuple

from jaxmon._base.hook import Hook
from jaxmon._base.triggers import SecondOrStepTimer, Trigger

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
    """The schedule of `hook`: its own `next_trigger`, else what its older members say."""
    owner = _defining_class(hook, "next_trigger")
    if owner is not Hook:
        asked = hook.next_trigger
        return Schedule(asked if _trusted(hook, owner) else None, lambda step: steps_to(asked(step), step))
    legacy = {"timer", "idle_between_triggers", "steps_to_next_trigger"} & _members(hook)
    if not legacy:
        return Schedule(None, None)
    warnings.warn(f"{type(hook).__name__} schedules itself with {sorted(legacy)}, which are deprecated: define "
                  "next_trigger(step) -> jm.Trigger | None instead (a timer's is timer.next_trigger(step)).",
                  DeprecationWarning, stacklevel=5)  # the session's construction
    cut = getattr(hook, "steps_to_next_trigger", None) or partial(_timer_steps, hook)
    sleeps = getattr(hook, "idle_between_triggers", False) and _trusted(hook, _defining_class(
        hook, "idle_between_triggers"))
    return Schedule(_legacy_next(hook, cut) if sleeps else None, cut)


def steps_to(trigger: Trigger | None, step: int) -> int | None:
    """How many steps from `step` a multi-step run must end for `trigger` (None: any will do)."""
    if trigger is None or not trigger.exact or trigger.step == math.inf:
        return None
    return max(1, int(trigger.step) - step)


def _legacy_next(hook: Any, cut: Callable[[int], int | None]) -> Callable[[int], Trigger | None]:
    """`next_trigger` of an older hook that said `idle_between_triggers`: the step its
    `steps_to_next_trigger` (or its timer) names, or its seconds timer's time."""

    def next_trigger(step: int) -> Trigger | None:
        steps = cut(step)
        if steps:
            return Trigger(step + steps)
        timer = _timer(hook)
        return None if timer is None or timer.every_steps else timer.next_trigger(step)

    return next_trigger


def _timer_steps(hook: Any, step: int) -> int | None:
    """Steps from `step` to the next step-based trigger of the hook's timer, if it has one."""
    timer = _timer(hook)
    return None if timer is None else timer.steps_to_next_trigger(step)


def _timer(hook: Any) -> SecondOrStepTimer | None:
    timer = getattr(hook, "timer", None)
    return timer if isinstance(timer, SecondOrStepTimer) else None


def _members(hook: Any) -> set[str]:
    names = set(vars(hook))
    for cls in type(hook).__mro__[:-1]:
        if cls is Hook:
            break
        names |= set(vars(cls))
    return names


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
