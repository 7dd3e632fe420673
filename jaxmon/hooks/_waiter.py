"""GlobalStepWaiterHook: wait for a watched run to reach a step before the first run."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable

from jaxmon._base.errors import check_number
from jaxmon._base.hook import Hook, RunContext
from jaxmon._checkpoints import manager as _checkpoint

logger = logging.getLogger("jaxmon")


class GlobalStepWaiterHook(Hook):
    """Delays the first run until a watched step reaches `wait_until_step`.

    For a side-car job (an evaluator, a staggered worker) that must not start before a
    training run has made progress.

    With JAX's multi-controller runtime there are no TF-style workers that lag the
    chief: every process of one run takes every step together. So the hook belongs to
    a separate job (its own `jax.distributed` group, or none) that watches a run's
    checkpoint directory, e.g. an evaluator started beside the training. Inside a
    multi-process run every process waits, and the first run starts on all of them
    together once each has seen the step.

    Args:
      wait_until_step: the step to wait for; <= 0 starts at once.
      watch: where the step comes from: a training run's checkpoint directory (its
        latest complete checkpoint step), a function returning the step (or None), or
        None for this session's own step (useful after a restore; nothing can advance
        it while waiting, so a session below the step fails at once).
      timeout_secs: give up with `TimeoutError` after this long (None: wait forever).
      poll_secs: seconds between reads.
      clock, sleep: injectable time functions (tests pass fakes).

    Example:
      >>> import jaxmon as jm
      >>> hook = jm.GlobalStepWaiterHook(1000, watch="runs/train", timeout_secs=3600)
    """

    def __init__(self, wait_until_step: int, *, watch: str | os.PathLike | Callable[[], int | None] | None = None,
                 timeout_secs: float | None = None, poll_secs: float = 0.5,
                 clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep):
        if not isinstance(wait_until_step, int) or isinstance(wait_until_step, bool):
            raise ValueError(f"GlobalStepWaiterHook wait_until_step must be an int; got {wait_until_step!r}.")
        if timeout_secs is not None:
            check_number("GlobalStepWaiterHook timeout_secs", timeout_secs)
        check_number("GlobalStepWaiterHook poll_secs", poll_secs)
        if watch is not None and not (callable(watch) or isinstance(watch, (str, os.PathLike))):
            raise TypeError(f"GlobalStepWaiterHook watch must be a directory, a function returning a step, or "
                            f"None; got {watch!r}.")
        self.wait_until_step, self.watch = wait_until_step, watch
        self.timeout_secs, self.poll_secs = timeout_secs, poll_secs
        self._clock, self._sleep = clock, sleep
        self._started = False

    def begin(self) -> None:
        self._started = self.wait_until_step <= 0

    def before_run(self, ctx: RunContext) -> None:
        if self._started:
            return
        start = self._clock()
        last_logged = None
        while True:
            step = ctx.step if self.watch is None else self._read()
            if step is not None and step >= self.wait_until_step:
                self._started = True
                return
            if self.watch is None:
                raise RuntimeError(f"GlobalStepWaiterHook waits for step {self.wait_until_step}, but this session "
                                   f"is at step {step} and nothing else advances it: pass watch= (the training "
                                   "run's checkpoint directory, or a function returning its step).")
            waited = self._clock() - start
            if self.timeout_secs is not None and waited >= self.timeout_secs:
                raise TimeoutError(f"GlobalStepWaiterHook waited {waited:.0f}s for step {self.wait_until_step} of "
                                   f"{self.watch!r}; it is at step {step}. Raise timeout_secs, or check that run.")
            if last_logged is None or (step or 0) - last_logged >= 1000:
                logger.info("Waiting for step %d of %r (now at %s).", self.wait_until_step, self.watch, step)
                last_logged = step or 0
            self._sleep(self.poll_secs)

    def _read(self) -> int | None:
        if callable(self.watch):
            return self.watch()
        return latest_checkpoint_step(self.watch)

    def __repr__(self) -> str:
        return f"GlobalStepWaiterHook({self.wait_until_step}, watch={self.watch!r})"


def latest_checkpoint_step(directory: str | os.PathLike) -> int | None:
    """The largest step among the complete checkpoints in `directory` (None if none)."""
    return max(_checkpoint.complete_steps(directory), default=None)
