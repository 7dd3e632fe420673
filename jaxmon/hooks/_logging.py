"""LoggingHook: fetched values logged every N iterations or seconds; and making
jaxmon's INFO lines visible, for the hooks that report through them."""

from __future__ import annotations

import inspect
import logging
import math
import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from jaxmon import _fetches
from jaxmon._errors import check_on_error
from jaxmon._hook import RunArgs, RunContext, RunValues
from jaxmon._metrics import Mean, check_reduce
from jaxmon._triggers import Trigger, timer_for
from jaxmon.hooks._timed import TimedHook

logger = logging.getLogger("jaxmon")


def show_info_logs() -> None:
    """Makes jaxmon's INFO lines (logged values, step rates, evaluations) visible unless
    the program chose otherwise.

    Python shows only warnings by default, and libraries that log through the
    module-level `logging.info` (absl, hence Orbax) give the root logger a handler as a
    side effect, so "no handler" cannot tell whether the program set logging up. The
    rule: if the `jaxmon` logger has no level of its own and the root logger is at its
    default WARNING, the `jaxmon` logger is set to INFO; its lines then go to the root
    logger's handlers, or, when there are none yet, to a handler of its own (not
    propagated, so a handler added to the root later does not print them twice). Set
    `logging.getLogger("jaxmon").setLevel(...)` (or the root's level) to choose.
    """
    if logger.level != logging.NOTSET or logging.getLogger().level != logging.WARNING:
        return
    logger.setLevel(logging.INFO)
    if not logger.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s", "%H:%M:%S"))
        logger.addHandler(handler)
        logger.propagate = False


class LoggingHook(TimedHook):
    """Logs fetched values every N local iterations or seconds, and/or at the end
    (TF's `LoggingTensorHook`), under the `jaxmon` logger at INFO.

    Values are read one run late (no device wait). Iterations are counted from 0 in
    each session, so `every_n_iter=10` logs iterations 0, 10, 20, ... With
    `reduce="mean"` (the default) a fetch naming a scalar output is logged as its mean
    over the steps since the previous line, accumulated on the device (see
    `jm.Mean`); other fetches are their value at the logged step.

    Args:
      fetches: what to log: a dict `{tag: name or fn(state, batch, outputs)}` (logged
        in sorted tag order), or a list of output names (in the given order).
      every_n_iter, every_n_secs: the period; give exactly one, unless `at_end` alone.
      at_end: also log the values on the final state at `end` (the last step's
        values, not means).
      formatter: `formatter(values: dict) -> str`, or `formatter(values, step=...)`
        to get the step after the logged run too; the default is `"step N: tag =
        value, ..."` with the seconds since the previous line.
      reduce: "mean" (default) or "last" (TF's value of the logged step) for fetches
        that name scalar outputs.
      on_error: "raise" (default) or "warn" (keep training if logging fails).

    Example:
      >>> import jaxmon as jm
      >>> hook = jm.LoggingHook(["loss", "accuracy"], every_n_iter=100)
    """

    def __init__(self, fetches: Any, every_n_iter: int | None = None, every_n_secs: float | None = None,
                 at_end: bool = False, formatter: Callable[[dict[str, Any]], str] | None = None,
                 reduce: str = "mean", *, on_error: str = "raise", clock: Callable[[], float] = time.monotonic):
        self.timer = timer_for(
            "LoggingHook", clock, at_end=at_end, every_n_iter=every_n_iter, every_n_secs=every_n_secs,
            error=("either at_end and/or exactly one of every_n_iter and every_n_secs must be provided (got "
                   f"every_n_iter={every_n_iter!r}, every_n_secs={every_n_secs!r}, at_end={at_end!r})."),
            steps_error=f"invalid every_n_iter={every_n_iter!r}: it must be an int >= 1.")
        if formatter is not None and not callable(formatter):
            raise TypeError(f"LoggingHook formatter must be a function formatter(values) -> str; got {formatter!r}.")
        self._formatter_takes_step = formatter is not None and _takes_step(formatter)
        self._fetches = _fetches.normalize(fetches, "LoggingHook fetches")
        if not self._fetches:
            raise ValueError(f"LoggingHook needs something to log: an output name, a list, or a dict; got {fetches!r}.")
        self._tags = sorted(self._fetches) if isinstance(fetches, Mapping) else list(self._fetches)
        self.at_end, self.formatter, self.reduce = at_end, formatter, check_reduce("LoggingHook", reduce)
        self._names = {tag: spec for tag, spec in self._fetches.items() if isinstance(spec, str)}
        if reduce == "mean" and self._names:
            self.accumulators = {"mean": Mean(sorted(set(self._names.values())))}
        self.on_error = check_on_error("LoggingHook", on_error)
        self._iter_count = 0
        # With one step per run an iteration is a step: the session may then skip the
        # runs between triggers, and the count is `_iter_count` at step `_counted_at`
        # plus the steps since. Otherwise every run is counted as it comes.
        self._counted_at: int | None = None
        self._session: Any = None
        self._elapsed: dict[int, float | None] = {}

    def begin(self) -> None:
        show_info_logs()
        self.timer.reset()
        self._iter_count, self._counted_at = 0, None
        self._elapsed.clear()

    def after_create_session(self, session) -> None:
        self._session = session
        self._counted_at = session.step if session.steps_per_dispatch == 1 else None

    def _iterations(self, step: int) -> int:
        """The iterations counted before a run that starts at `step`."""
        return self._iter_count if self._counted_at is None else self._iter_count + step - self._counted_at

    def get_state(self) -> dict[str, Any]:
        count = self._iter_count if self._session is None else self._iterations(self._session.step)
        return {**super().get_state(), "iter_count": count}

    def set_state(self, state: dict[str, Any]) -> None:
        super().set_state(state)
        self._iter_count, self._counted_at = state["iter_count"], None

    def next_trigger(self, step: int) -> Trigger | None:
        """It counts runs (iterations), as TF's LoggingTensorHook did: no run need end
        anywhere. With one step per run it sleeps until its iteration comes."""
        if self._counted_at is None:
            return None  # runs of several steps: each is counted as it comes
        iteration = self._iterations(step)
        trigger = self.timer.next_trigger(iteration, exact=False)
        if trigger is None or trigger.step == math.inf:
            return trigger
        return trigger._replace(step=step + trigger.step - iteration)

    def before_run(self, ctx: RunContext) -> RunArgs | None:
        iteration = self._iterations(ctx.step)
        if self._counted_at is None:
            self._iter_count += 1
        else:
            self._iter_count, self._counted_at = iteration + 1, ctx.step + 1
        if not self.timer.should_trigger_for_step(iteration):
            return None
        self._elapsed[ctx.step] = self.timer.update_last_triggered_step(iteration)[0]
        return RunArgs(fetches=dict(self._fetches), late=True, read=bool(self.accumulators))

    def after_run(self, ctx: RunContext, values: RunValues) -> None:
        if values.results is not None:
            results = values.results
            if values.accumulated:
                means = values.accumulated["mean"]
                results = {tag: means.get(self._names.get(tag), value) for tag, value in results.items()}
            self._log(results, self._elapsed.pop(ctx.step, None), values.step)

    def end(self, session) -> None:
        if self.at_end and self._iterations(session.step):
            self._log(session.fetch(dict(self._fetches)), None, session.step)

    def _log(self, values: dict[str, Any], elapsed: float | None, step: int) -> None:
        if self.formatter is not None:
            text = self.formatter(values, step=step) if self._formatter_takes_step else self.formatter(values)
            logger.info("%s", text)
            return
        with np.printoptions(suppress=True):
            line = ", ".join(f"{tag} = {values[tag]}" for tag in self._tags)
        if elapsed is None:
            logger.info("step %d: %s", step, line)
        else:
            logger.info("step %d: %s (%.3f sec)", step, line, elapsed)

    def __repr__(self) -> str:
        return f"LoggingHook({self._tags!r}, {self.timer!r})"


def _takes_step(formatter: Callable[..., str]) -> bool:
    """Whether `formatter` accepts a `step=` keyword (TF's took the values alone)."""
    try:
        parameters = inspect.signature(formatter).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.name == "step" or p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)


LoggingTensorHook = LoggingHook
