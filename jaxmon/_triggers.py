"""The shared interval timer of periodic hooks: every N steps or every N seconds."""

from __future__ import annotations

import time
from collections.abc import Callable

from jaxmon._errors import check_int, check_number


class SecondOrStepTimer:
    """Says when a periodic action is due, by steps or by seconds (TF semantics).

    The first query is always due. After that, a step is due when `every_steps` steps
    or `every_secs` seconds have passed since the last *recorded* trigger, and never
    twice for the same step. Asking does not record: call
    `update_last_triggered_step(step)` when the action ran. Step jumps (several steps
    per dispatch, a restored step) fire once, at the first step past the interval.

    Args:
      every_secs: seconds between triggers (>= 0).
      every_steps: steps between triggers (>= 1). Give exactly one of the two.
      clock: a function returning seconds (default `time.monotonic`); tests pass a fake.

    Example:
      >>> timer = SecondOrStepTimer(every_steps=3)
      >>> [s for s in range(1, 11) if timer.should_trigger_for_step(s)
      ...  and timer.update_last_triggered_step(s)]
      [1, 4, 7, 10]
    """

    def __init__(
        self,
        every_secs: float | None = None,
        every_steps: int | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
    ):
        if every_secs is None and every_steps is None:
            raise ValueError("Either every_secs or every_steps should be provided.")
        if every_secs is not None and every_steps is not None:
            raise ValueError(f"Can not provide both every_secs and every_steps (got every_secs={every_secs!r}, "
                             f"every_steps={every_steps!r}); keep one.")
        if every_steps is not None:
            check_int("every_steps", every_steps, minimum=1)
        if every_secs is not None:
            check_number("every_secs", every_secs)
        self.every_secs = every_secs
        self.every_steps = every_steps
        self._clock = clock
        self.reset()

    def reset(self) -> None:
        """Forgets the last trigger: the next query is due."""
        self._last_step: int | None = None
        self._last_time: float | None = None

    def should_trigger_for_step(self, step: int) -> bool:
        """Whether the action is due at `step` (does not record anything)."""
        if self._last_step is None:
            return True
        if step == self._last_step:
            return False
        if self.every_secs is not None:
            return self._clock() >= self._last_time + self.every_secs
        return step >= self._last_step + self.every_steps

    def update_last_triggered_step(self, step: int) -> tuple[float | None, int | None]:
        """Records a trigger at `step`; returns (seconds, steps) since the previous one,
        or (None, None) for the first."""
        now = self._clock()
        elapsed = (None, None) if self._last_step is None else (now - self._last_time, step - self._last_step)
        self._last_step, self._last_time = step, now
        return elapsed

    def due(self, step: int) -> bool:
        """Whether the action is due at `step`, recording the trigger if it is (CLU's
        `PeriodicAction` check): `if timer.due(step): act()`."""
        if not self.should_trigger_for_step(step):
            return False
        self.update_last_triggered_step(step)
        return True

    def steps_to_next_trigger(self, step: int) -> int | None:
        """Steps from `step` to the next step-based trigger (at least 1), or None for a
        timer that counts seconds."""
        if not self.every_steps:
            return None
        return 1 if self._last_step is None else max(1, self._last_step + self.every_steps - step)

    def use_clock(self, clock: Callable[[], float]) -> None:
        """Reads seconds from `clock` from now on (several JAX processes share the
        chief's clock this way, so that seconds-based triggers fire at one step)."""
        self._clock = clock

    def last_triggered_step(self) -> int | None:
        """The step of the last recorded trigger, or None."""
        return self._last_step

    def get_state(self) -> dict[str, int | None]:
        """The last trigger's step, for a checkpoint (times do not survive a restart)."""
        return {"last_step": self._last_step}

    def set_state(self, state: dict[str, int | None]) -> None:
        """Resumes from `get_state()`: the last trigger at its step, now."""
        self._last_step = state["last_step"]
        self._last_time = None if self._last_step is None else self._clock()

    def __repr__(self) -> str:
        if self.every_secs is not None:
            return f"SecondOrStepTimer(every_secs={self.every_secs})"
        return f"SecondOrStepTimer(every_steps={self.every_steps})"


class NeverTriggerTimer(SecondOrStepTimer):
    """A timer that is never due (for hooks that act only at `end`)."""

    def __init__(self):
        self.every_secs = self.every_steps = None
        self.reset()

    def should_trigger_for_step(self, step: int) -> bool:
        return False

    def update_last_triggered_step(self, step: int) -> tuple[None, None]:
        return None, None

    def __repr__(self) -> str:
        return "NeverTriggerTimer()"


def timer_for(owner: str, clock: Callable[[], float], **every: float | int | None) -> SecondOrStepTimer:
    """A hook's timer from its two interval arguments (steps first, seconds second),
    with an error that names the hook and its own argument names."""
    (steps_name, steps), (secs_name, secs) = every.items()
    if (steps is None) == (secs is None):
        raise ValueError(f"{owner} needs exactly one of {steps_name} and {secs_name}; got "
                         f"{steps_name}={steps!r}, {secs_name}={secs!r}.")
    if steps is not None:
        check_int(f"{owner} {steps_name}", steps, minimum=1)
    else:
        check_number(f"{owner} {secs_name}", secs)
    return SecondOrStepTimer(every_secs=secs, every_steps=steps, clock=clock)
