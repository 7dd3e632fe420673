"""TimedHook: the base of the built-in hooks that act when their timer is due."""

from __future__ import annotations

from typing import Any

from jaxmon._base.hook import Hook
from jaxmon._base.triggers import SecondOrStepTimer


class TimedHook(Hook):
    """A hook that acts when its `timer` is due: its timer's last trigger is saved with
    each checkpoint. Subclasses set `self.timer`, and say in `next_trigger` when they
    act (usually `self.timer.next_trigger(step)`): a subclass that replaces a run event
    without saying it again is called on every run."""

    timer: SecondOrStepTimer

    def get_state(self) -> dict[str, Any] | None:
        return {"timer": self.timer.get_state()}

    def set_state(self, state: dict[str, Any]) -> None:
        if "timer" in state:
            self.timer.set_state(state["timer"])
