"""Small control hooks: NaN checks, feeds, final fetches, waiting for a step, periodic calls."""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from jaxmon import _checkpoint, _fetches
from jaxmon._errors import NanLossDuringTrainingError, check_number, check_on_error
from jaxmon._hook import Hook, RunArgs, RunContext, RunValues
from jaxmon._triggers import timer_for

logger = logging.getLogger("jaxmon")


class NanHook(Hook):
    """Stops training when the loss is NaN or infinite (TF's `NanTensorHook`).

    The check never makes the device wait: the loss is read one step late (see
    `RunArgs.late`), so the hook acts in the run *after* the non-finite step, or at
    `sess.sync()` or `close()` if that step was the last. The error names the
    non-finite step and its value.

    Args:
      fetch: the loss: an output name (read from the outputs, nothing recompiles) or a
        callable `fn(state, batch, outputs)`. Arrays are checked element-wise.
      fail_on_nan_loss: raise `NanLossDuringTrainingError` (default), or log a warning
        and stop the loop cleanly.

    Example:
      >>> import jaxmon as jm
      >>> hook = jm.NanHook("loss", fail_on_nan_loss=False)
    """

    def __init__(self, fetch: Any = "loss", fail_on_nan_loss: bool = True):
        _fetches.normalize({"value": fetch}, "NanHook fetch")
        self.fetch, self.fail_on_nan_loss = fetch, fail_on_nan_loss
        # An output name is read from the outputs as they are: nothing to fetch, per step
        # the hook costs one late call and one read of a finished array.
        self._args = RunArgs(late=True) if isinstance(fetch, str) else RunArgs({"value": fetch}, late=True)
        self._stopped = False  # after a clean stop, the runs already queued need no second warning

    def begin(self) -> None:
        self._stopped = False

    def before_run(self, ctx: RunContext) -> RunArgs:
        return self._args

    def after_run(self, ctx: RunContext, values: RunValues) -> None:
        if self._stopped:
            return
        if isinstance(self.fetch, str):
            if self.fetch not in values.outputs:
                raise ValueError(f"NanHook checks {self.fetch!r}, which is not an output of the step function; "
                                 f"its outputs are {sorted(values.outputs)}. Pass NanHook(fetch=<the loss's name>).")
            value = np.asarray(values.outputs[self.fetch])
        else:
            value = np.asarray(values.results["value"])
        if value.ndim == 0 and math.isfinite(value):
            return
        finite = np.isfinite(value)
        if finite.all():
            return
        bad = value.size - int(finite.sum())
        shown = value.item() if value.size == 1 else f"{bad} of {value.size} entries non-finite"
        where = f"{self.fetch!r} = {shown} at step {values.step}"
        if self.fail_on_nan_loss:
            logger.error("Model diverged with loss = NaN: %s.", where)
            raise NanLossDuringTrainingError(
                f"NaN loss during training: {where}. Lower the learning rate, clip gradients, or check "
                "the data of that step; NanHook(fail_on_nan_loss=False) stops cleanly instead.",
                step=values.step, value=shown)
        logger.warning("NaN loss during training: %s; stopping.", where)
        self._stopped = True
        ctx.session.reject_state(f"NanHook saw {where}")
        ctx.request_stop()

    def __repr__(self) -> str:
        return f"NanHook({self.fetch!r}, fail_on_nan_loss={self.fail_on_nan_loss})"


NanTensorHook = NanHook


class FeedFnHook(Hook):
    """Merges `feed_fn()` (a dict) into the batch of every run.

    Example:
      >>> import jaxmon as jm
      >>> hook = jm.FeedFnHook(lambda: {"dropout_rate": 0.1})
    """

    def __init__(self, feed_fn: Callable[[], dict[str, Any]]):
        if not callable(feed_fn):
            raise TypeError(f"FeedFnHook feed_fn must be a function returning a dict of feeds; got {feed_fn!r}.")
        self.feed_fn = feed_fn

    def before_run(self, ctx: RunContext) -> RunArgs:
        return RunArgs(feeds=self.feed_fn())

    def __repr__(self) -> str:
        return f"FeedFnHook({getattr(self.feed_fn, '__qualname__', self.feed_fn)!r})"


class FinalOpsHook(Hook):
    """Computes fetches once at `end`, on the last run's state, batch and outputs.

    Args:
      final_fetches: as `RunArgs.fetches` (output names or callables).

    Example:
      >>> import jaxmon as jm
      >>> hook = jm.FinalOpsHook({"norm": lambda state, batch, outputs: (state ** 2).sum()})
    """

    def __init__(self, final_fetches: Any):
        if not _fetches.normalize(final_fetches, "FinalOpsHook final_fetches"):
            raise ValueError("FinalOpsHook needs final_fetches: an output name, a list of names, or a dict.")
        self.final_fetches = final_fetches
        self._final_values: dict[str, Any] | None = None
        self._ran = False

    @property
    def final_values(self) -> dict[str, Any] | None:
        """The fetched values as host NumPy after `end`; None before (or if no step ran)."""
        return self._final_values

    final_ops_values = final_values

    def begin(self) -> None:
        self._final_values, self._ran = None, False

    def after_run(self, ctx: RunContext, values: RunValues) -> None:
        self._ran = True

    def end(self, session) -> None:
        if not self._ran:
            logger.warning("FinalOpsHook: no step ran in this session, so there is nothing to fetch; "
                           "final_values stays None.")
            return
        self._final_values = session.fetch(self.final_fetches)

    def __repr__(self) -> str:
        return f"FinalOpsHook({self.final_fetches!r})"


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


class PeriodicHook(Hook):
    """Calls `fn(session)` every N steps or seconds (TF Supervisor's `loop`).

    The first call is after the first run; `at_end=True` calls it once more at `end`
    unless it just ran for the last step.

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

    def begin(self) -> None:
        self.timer.reset()

    def after_run(self, ctx: RunContext, values: RunValues) -> None:
        if self.timer.should_trigger_for_step(values.step):
            self.timer.update_last_triggered_step(values.step)
            self.fn(ctx.session)

    def end(self, session) -> None:
        if self.at_end and self.timer.last_triggered_step() != session.step:
            self.timer.update_last_triggered_step(session.step)
            self.fn(session)

    def __repr__(self) -> str:
        return f"PeriodicHook({getattr(self.fn, '__qualname__', self.fn)!r}, {self.timer!r})"
