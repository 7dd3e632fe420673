"""EarlyStoppingHook: stop training when a metric stops improving."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from jaxmon._base import fetches as _fetches
from jaxmon._base.errors import check_int, check_number
from jaxmon._base.hook import Hook, RunArgs, RunContext, RunValues
from jaxmon._base.triggers import Trigger, timer_for
from jaxmon.hooks._eval import EvalHook

logger = logging.getLogger("jaxmon")


class EarlyStoppingHook(Hook):
    """Stops training when a metric has not improved for `patience` checks.

    The metric comes from an `EvalHook` (`source=`; checked after each of its
    evaluations — list the `EvalHook` first to act on the same step), or from the
    training step's outputs (`fetch` an output name or a callable), checked every
    `every_n_steps` steps (default 100) or `every_n_secs` seconds.

    The stop is part of the hook's checkpointed state: a session resumed from the
    checkpoint of a stopped run stops before its first step, as a run past its
    `StopAtStepHook` does. A larger `patience` than the checks already waited trains on
    (the count goes on); so does a new `checkpoint_dir`.

    Args:
      fetch: the metric: a name of the source's metrics or of the step's outputs, or
        a callable `fn(state, batch, outputs)`.
      mode: "min" (lower is better) or "max".
      patience: how many checks without improvement to allow before stopping.
      min_delta: the smallest change that counts as an improvement.
      source: an `EvalHook` whose evaluations to watch.
      baseline: a value the metric must beat to count as improving at all.

    Attributes:
      best, best_step: the best value so far and its step.
      stopped_step: the step at which it stopped training, or None.

    Example:
      >>> import jaxmon as jm
      >>> evaluate = jm.EvalHook(lambda s, b: {"loss": s}, data=[0], every_n_steps=500)
      >>> stop = jm.EarlyStoppingHook("loss", mode="min", patience=3, source=evaluate)
    """

    def __init__(self, fetch: Any, mode: str = "min", patience: int = 10, min_delta: float = 0.0, *,
                 source: EvalHook | None = None, every_n_steps: int | None = None, every_n_secs: float | None = None,
                 baseline: float | None = None, clock: Callable[[], float] = time.monotonic):
        if mode not in ("min", "max"):
            raise ValueError(f"EarlyStoppingHook mode must be 'min' or 'max'; got {mode!r}.")
        check_int("EarlyStoppingHook patience", patience)
        check_number("EarlyStoppingHook min_delta", min_delta)
        if source is not None:
            if not isinstance(source, EvalHook):
                raise TypeError(f"EarlyStoppingHook source must be an EvalHook; got {source!r}.")
            if not isinstance(fetch, str) or every_n_steps is not None or every_n_secs is not None:
                raise ValueError("With source=, fetch names one of the EvalHook's metrics and the EvalHook's "
                                 f"period applies; got fetch={fetch!r}, every_n_steps={every_n_steps!r}, "
                                 f"every_n_secs={every_n_secs!r}.")
            self.timer = None
        else:
            _fetches.normalize({"value": fetch}, "EarlyStoppingHook fetch")
            self.timer = timer_for("EarlyStoppingHook", clock, default_steps=100, every_n_steps=every_n_steps,
                                   every_n_secs=every_n_secs)
        self.fetch, self.mode, self.patience, self.min_delta = fetch, mode, patience, min_delta
        self.source, self.baseline = source, baseline
        self._fetches = {"value": fetch}
        self.begin()

    def begin(self) -> None:
        self.best = self.baseline
        self.best_step: int | None = None
        self.stopped_step: int | None = None
        self._waited = 0
        self._seen = 0

    def next_trigger(self, step: int) -> Trigger | None:
        return None if self.timer is None else self.timer.next_trigger(step)  # with source=: every run

    def get_state(self) -> dict[str, Any]:
        timer = {} if self.timer is None else {"timer": self.timer.get_state()}
        return {**timer, "best": self.best, "best_step": self.best_step,
                "waited": self._waited, "seen": self._seen, "stopped_step": self.stopped_step}

    def set_state(self, state: dict[str, Any]) -> None:
        if self.timer is not None and "timer" in state:
            self.timer.set_state(state["timer"])
        self.best, self.best_step, self._waited, self._seen = (state["best"], state["best_step"], state["waited"],
                                                               state["seen"])
        self.stopped_step = state.get("stopped_step")  # None in checkpoints written before it was kept

    def after_create_session(self, session) -> None:
        if self.timer is not None:
            self.timer.start(session.step)  # counts from the restored step (and time waited)
        if self.stopped_step is None:
            return
        if self._waited < max(self.patience, 1):  # a larger patience: the run goes on waiting
            logger.info("EarlyStoppingHook: the restored run stopped early at step %d after %d checks without "
                        "improvement; patience=%d allows more, so training goes on.", self.stopped_step,
                        self._waited, self.patience)
            self.stopped_step = None
            return
        logger.info("EarlyStoppingHook: this run stopped early at step %d (%r had not improved by more than %g for "
                    "%d checks; best %s at step %s), so the session stops before its first step. To train further, "
                    "give patience > %d (the count goes on), drop the EarlyStoppingHook, or start in a new "
                    "checkpoint_dir.", self.stopped_step, self.fetch, self.min_delta, self._waited, self.best,
                    self.best_step, self._waited)
        session.request_stop()

    def before_run(self, ctx: RunContext) -> RunArgs | None:
        if self.timer is None or not self.timer.due(ctx.next_step):
            return None
        return RunArgs(fetches=self._fetches)

    def after_run(self, ctx: RunContext, values: RunValues) -> None:
        if self.source is not None:
            if len(self.source.history) > self._seen:
                self._seen = len(self.source.history)
                step, metrics = self.source.history[-1]
                if self.fetch not in metrics:
                    raise ValueError(f"EarlyStoppingHook watches {self.fetch!r}, but {self.source!r} reports "
                                     f"{sorted(metrics)}.")
                self._check(ctx, step, metrics[self.fetch])
        elif values.results is not None:
            value = np.asarray(values.results["value"])
            if value.size != 1:
                raise ValueError(f"EarlyStoppingHook watches {self.fetch!r}, which has shape {value.shape}; "
                                 "it needs a single value (reduce it, e.g. fetch a callable returning its mean).")
            self._check(ctx, values.step, value.item())

    def _check(self, ctx: RunContext, step: int, value: float) -> None:
        better = (value < self.best - self.min_delta if self.mode == "min" else value > self.best + self.min_delta) \
            if self.best is not None else math.isfinite(value)
        if better:
            self.best, self.best_step, self._waited = value, step, 0
            return
        self._waited += 1
        if self._waited >= max(self.patience, 1):
            self.stopped_step = ctx.next_step
            logger.info("EarlyStoppingHook: %r has not improved by more than %g for %d checks (best %s at step "
                        "%s); stopping at step %d.", self.fetch, self.min_delta, self._waited, self.best,
                        self.best_step, self.stopped_step)
            ctx.request_stop()

    def __repr__(self) -> str:
        return f"EarlyStoppingHook({self.fetch!r}, mode={self.mode!r}, patience={self.patience})"
