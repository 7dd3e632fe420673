"""PeriodicHook: call a function every N steps or seconds."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from jaxmon._base.errors import check_on_error
from jaxmon._base.hook import RunContext, RunValues
from jaxmon._base.timed import TimedHook
from jaxmon._base.triggers import Trigger, timer_for


class PeriodicHook(TimedHook):
    """Calls `fn(session)` every N steps or seconds (TF Supervisor's `loop`).

    It calls after steps N, 2N, ... for `every_n_steps=N` (a resumed run keeps the
    schedule), or every `every_n_secs` seconds from the session's start; `at_end=True`
    calls it once more at `end` unless it just ran for the last step.

    Example:
      >>> import jaxmon as jm
      >>> hook = jm.PeriodicHook(lambda session: print(session.step), every_n_steps=1000)
    """


    def __init__(self, fn: Callable[[Any], None], every_n_steps: int | None = None,
                 every_n_secs: float | None = None, *, at_end: bool = False, on_error: str = "raise",
                 clock: Callable[[], float] = time.monotonic):
        if not callable(fn):
            raise TypeError(f"PeriodicHook fn must be a function fn(session); got {fn!r}.")
        self.fn, self.at_end = fn, at_end
        self.timer = timer_for("PeriodicHook", clock, every_n_steps=every_n_steps, every_n_secs=every_n_secs)
        self.on_error = check_on_error("PeriodicHook", on_error)

    def next_trigger(self, step: int) -> Trigger | None:
        return self.timer.next_trigger(step)

    def begin(self) -> None:
        self.timer.reset()

    def after_create_session(self, session) -> None:
        self.timer.start(session.step)

    def after_run(self, ctx: RunContext, values: RunValues) -> None:
        if self.timer.due(values.step):
            self.fn(ctx.session)

    def end(self, session) -> None:
        if self.at_end and self.timer.last_triggered_step() != session.step:
            self.timer.update_last_triggered_step(session.step)
            self.fn(session)

    def __repr__(self) -> str:
        return f"PeriodicHook({getattr(self.fn, '__qualname__', self.fn)!r}, {self.timer!r})"
