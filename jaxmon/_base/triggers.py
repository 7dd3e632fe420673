"""The shared interval timer of periodic hooks: every N steps or every N seconds."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import NamedTuple

from jaxmon._base.errors import check_int, check_number


class Trigger(NamedTuple):
    """When a hook must next act (what `Hook.next_trigger` returns): after the run
    that reaches `step`, or after the first run once `clock()` reaches `time`,
    whichever comes first. Until then the session skips the hook's `before_run` and
    `after_run`.

    Attributes:
      step: the step number after the run on which the hook acts next (inf: none).
      time: the time on `clock` from which it acts on every run (inf: none).
      clock: the clock `time` is on.
      exact: with several steps per run, end a run exactly at `step` (False: a
        later run will do, e.g. a check that may come a few steps late).

    Example:
      >>> Trigger(step=100)  # acts on the run that reaches step 100
      Trigger(step=100, time=inf, clock=None, exact=True)
    """

    step: float = math.inf
    time: float = math.inf
    clock: Callable[[], float] | None = None
    exact: bool = True


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

    def rate(self, step: int) -> float | None:
        """Records a trigger at `step`; returns the steps a second since the previous one
        (None for the first, or when no time or no step passed): a period's speed."""
        secs, steps = self.update_last_triggered_step(step)
        return steps / secs if secs and steps is not None and steps > 0 else None

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

    def next_trigger(self, step: int, exact: bool = True) -> Trigger | None:
        """The `Trigger` of a hook that acts when this timer is due, asked after `step`;
        None while it has never triggered (it is due at the next run)."""
        if self.every_steps:
            return Trigger(step + self.steps_to_next_trigger(step), exact=exact)
        deadline = self.next_trigger_time()
        return None if deadline is None else Trigger(time=deadline, clock=self._clock)

    def next_trigger_time(self) -> float | None:
        """The time (on `clock`) of the next seconds-based trigger, or None for a timer
        that counts steps or has not triggered yet (it is due now)."""
        if self.every_secs is None or self._last_time is None:
            return None
        return self._last_time + self.every_secs

    @property
    def clock(self) -> Callable[[], float]:
        """The function this timer reads seconds from."""
        return self._clock

    def use_clock(self, clock: Callable[[], float]) -> None:
        """Reads seconds from `clock` from now on (several JAX processes share the
        chief's clock this way, so that seconds-based triggers fire at one step)."""
        self._clock = clock

    def opening(self, step: int) -> bool:
        """Whether an action at `step` is a starting point that ends no window (see
        `Every.opening`): never, for TF's timer."""
        return False

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


class Every(SecondOrStepTimer):
    """The schedule of the built-in hooks: every N steps acts after steps N, 2N, 3N, ...
    counted from step 0, so a resumed or a restarted run keeps it; every N seconds acts
    on the first run that ends N seconds after the last action (or the `start`), and
    a checkpoint keeps how long it has waited. With `first`, also after step 1 (see
    `opening`).

    `jm.SecondOrStepTimer` keeps TF's rules (the first query is due; every N steps
    counts from the last trigger) for code that uses it directly.

    Example:
      >>> timer = Every(every_steps=4, first=True)
      >>> timer.start(0)
      >>> [s for s in range(1, 13) if timer.due(s)]
      [1, 4, 8, 12]
    """

    def __init__(self, every_secs: float | None = None, every_steps: int | None = None, *, first: bool = False,
                 clock: Callable[[], float] = time.monotonic):
        super().__init__(every_secs, every_steps, clock=clock)
        self.first = first

    def reset(self) -> None:
        super().reset()
        self._waited: float | None = None

    def start(self, step: int) -> None:
        """The session starts (or resumes) at `step`: seconds count from now, less how
        long the timer had waited when its checkpoint was saved (`set_state`)."""
        if self._last_time is None:
            self._last_time = self._clock() - (self._waited or 0.0)
            self._waited = None
        if self._last_step is None or self._last_step > step:  # after a roll-back, its later triggers never were
            self._last_step = step

    def update_last_triggered_step(self, step: int) -> tuple[float | None, int | None]:
        if self._last_time is None and self._last_step is not None:  # restored by a hook that never started it
            self.start(step)
        return super().update_last_triggered_step(step)

    def should_trigger_for_step(self, step: int) -> bool:
        before = self._last_step or 0
        if step <= before:
            return False
        if self.first and before < 1:
            return True
        if self.every_steps:
            return step // self.every_steps > before // self.every_steps
        return self._last_time is None or self._clock() >= self._last_time + self.every_secs

    def opening(self, step: int) -> bool:
        """Whether an action at `step` is the one after step 1 that `first` adds (with
        several steps per run: after the first run), before any regular one: a reporter's
        window goes on through it, so that the next covers the steps from 1."""
        if not self.first or (self._last_step or 0) >= 1:
            return False
        return not self.every_steps or step < self.every_steps

    def next_trigger(self, step: int, exact: bool = True) -> Trigger | None:
        first = 1 if self.first and step < 1 else math.inf
        if self.every_steps:
            return Trigger(min(first, (step // self.every_steps + 1) * self.every_steps), exact=exact)
        if self._last_time is None:
            return None
        return Trigger(first, self._last_time + self.every_secs, self._clock, exact)

    def get_state(self) -> dict[str, int | float | None]:
        """The last action's step and, for seconds, how long ago it was."""
        waited = self._waited
        if self.every_secs is not None and self._last_time is not None:
            waited = self._clock() - self._last_time
        return {"last_step": self._last_step, "waited": waited}

    def set_state(self, state: dict[str, int | float | None]) -> None:
        """Resumes from `get_state()`; seconds go on counting at `start`."""
        self._last_step, self._last_time, self._waited = state["last_step"], None, state.get("waited")

    def __repr__(self) -> str:
        every = f"every_secs={self.every_secs}" if self.every_secs is not None else f"every_steps={self.every_steps}"
        return f"Every({every}{', first=True' if self.first else ''})"


class NeverTriggerTimer(SecondOrStepTimer):
    """A timer that is never due (for hooks that act only at `end`)."""

    def __init__(self):
        self.every_secs = self.every_steps = None
        self.reset()

    def start(self, step: int) -> None:
        """Nothing to start (see `Every.start`)."""

    def should_trigger_for_step(self, step: int) -> bool:
        return False

    def update_last_triggered_step(self, step: int) -> tuple[None, None]:
        return None, None

    def next_trigger_time(self) -> float:
        return math.inf

    def next_trigger(self, step: int, exact: bool = True) -> Trigger:
        return Trigger()

    def __repr__(self) -> str:
        return "NeverTriggerTimer()"


def timer_for(owner: str, clock: Callable[[], float], *, default_steps: int | None = None,
              at_end: bool | None = None, error: str | None = None, steps_error: str | None = None,
              first: bool = False, **every: float | int | None) -> Every:
    """A hook's timer from its two interval arguments: the one check of "every N steps
    or every N seconds" that every periodic hook makes.

    Exactly one of the two must be given, unless the hook says what neither means
    (`default_steps` or `at_end`).

    Args:
      owner: the hook's class name, which the errors name.
      clock: the timer's clock (the hook's `clock` argument).
      default_steps: neither means every `default_steps` steps.
      at_end: for a hook that may act only at its end, its `at_end`: neither with
        `at_end=True` gives a `NeverTriggerTimer`.
      error: the `ValueError` message when the intervals are not exactly one; the
        default names `owner`, both arguments and their values.
      steps_error: the `ValueError` message when the step interval is not an int >= 1;
        the default names `owner` and the argument.
      first: also act after step 1 (summaries and logging report the starting point).
      **every: the two interval arguments under the hook's own names, steps first and
        seconds second, e.g. `every_n_steps=100, every_n_secs=None`. A hook that
        offers only seconds passes None for steps.

    Returns:
      An `Every` schedule, or a `NeverTriggerTimer` for an at-end-only hook.

    Raises:
      ValueError: the intervals are not exactly one, or one is not a valid count.

    Example:
      >>> timer_for("MyHook", time.monotonic, every_n_steps=None, every_n_secs=30.0)
      Every(every_secs=30.0)
      >>> timer_for("MyHook", time.monotonic, at_end=True, every_n_steps=None, every_n_secs=None)
      NeverTriggerTimer()
    """
    (steps_name, steps), (secs_name, secs) = every.items()
    if steps is None and secs is None:
        if at_end:
            return NeverTriggerTimer()
        steps = default_steps
    if (steps is None) == (secs is None):
        if error is None:
            neither = ", or neither with at_end=True" if at_end is not None else ""
            shown = "" if at_end is None else f", at_end={at_end!r}"
            error = (f"{owner} needs exactly one of {steps_name} and {secs_name}{neither}; got "
                     f"{steps_name}={steps!r}, {secs_name}={secs!r}{shown}.")
        raise ValueError(error)
    if steps is not None:
        try:
            check_int(f"{owner} {steps_name}", steps, minimum=1)
        except ValueError:
            if steps_error is None:
                raise
            raise ValueError(steps_error) from None
    else:
        check_number(f"{owner} {secs_name}", secs)
    return Every(every_secs=secs, every_steps=steps, first=first, clock=clock)
