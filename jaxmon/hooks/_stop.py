"""StopAtStepHook: stop the loop at a step number."""

from __future__ import annotations

import logging

from jaxmon._base.errors import check_int
from jaxmon._base.hook import Hook, RunContext, RunValues
from jaxmon._base.triggers import Trigger

logger = logging.getLogger("jaxmon")


class StopAtStepHook(Hook):
    """Requests a stop once the step number reaches `last_step` (inclusive).

    Give exactly one of `num_steps` or `last_step`. `num_steps` counts from the step
    at which the run first started: the target is fixed at the first session
    creation and kept across recoveries, and a session restored from a checkpoint of
    the same run with the same `num_steps` keeps it (a preempted job ends where it was
    meant to). A different `num_steps` counts from the restored step, and the new
    target is logged. A session that starts at or past `last_step` is stopped before
    its first run.

    Example:
      >>> import jaxmon as jm
      >>> hook = jm.StopAtStepHook(num_steps=1000)
    """

    def __init__(self, num_steps: int | None = None, last_step: int | None = None):
        if num_steps is None and last_step is None:
            raise ValueError("One of num_steps or last_step must be specified: "
                             "StopAtStepHook(num_steps=N) or StopAtStepHook(last_step=N).")
        if num_steps is not None and last_step is not None:
            raise ValueError(f"Only one of num_steps or last_step can be specified; got "
                             f"num_steps={num_steps!r} and last_step={last_step!r}.")
        for name, value in (("num_steps", num_steps), ("last_step", last_step)):
            if value is not None:
                check_int(f"StopAtStepHook {name}", value)
        self._num_steps = num_steps
        self._last_step = last_step

    @property
    def last_step(self) -> int | None:
        """The step after which the loop stops (None until the session is created)."""
        return self._last_step

    def after_create_session(self, session) -> None:
        if self._last_step is None:
            self._last_step = session.step + self._num_steps
            if session.restored_step is not None:
                logger.info("StopAtStepHook(num_steps=%d) counts from the restored step %d (the checkpoint's run "
                            "had another num_steps, or none): training stops at step %d.", self._num_steps,
                            session.step, self._last_step)
        if session.step >= self._last_step:
            session.request_stop()

    def get_state(self) -> dict[str, int | None]:
        if self._num_steps is None:
            return {"last_step": self._last_step}
        return {"last_step": self._last_step, "num_steps": self._num_steps}

    def set_state(self, state: dict[str, int | None]) -> None:
        # The run being resumed fixed its target at its start; the same num_steps (or a
        # checkpoint that did not record it) keeps that target, a new one counts afresh.
        if self._num_steps is not None and state.get("num_steps", self._num_steps) == self._num_steps:
            self._last_step = state["last_step"]

    def next_trigger(self, step: int) -> Trigger | None:
        return None if self._last_step is None else Trigger(max(step + 1, self._last_step))

    def after_run(self, ctx: RunContext, values: RunValues) -> None:
        if values.step >= self._last_step:
            ctx.request_stop()

    def __repr__(self) -> str:
        if self._num_steps is not None:
            return f"StopAtStepHook(num_steps={self._num_steps})"
        return f"StopAtStepHook(last_step={self._last_step})"
