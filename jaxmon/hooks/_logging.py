"""LoggingHook: fetched values logged every N iterations or seconds; and making
jaxmon's INFO lines visible, for the hooks that report through them."""

from __future__ import annotations

import inspect
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from jaxmon._base import fetches as _fetches
from jaxmon._base.errors import check_on_error
from jaxmon._base.hook import RunArgs, RunContext, RunValues
from jaxmon._base.timed import TimedHook
from jaxmon._base.triggers import Trigger, timer_for
from jaxmon._metrics.reductions import Mean, Reduction, check_reduce, of_last_step
from jaxmon._ops import report_thread

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
    """Logs fetched values every N steps or seconds, and/or at the end (TF's
    `LoggingTensorHook`), under the `jaxmon` logger at INFO.

    It logs after step 1 (the starting point), then after steps N, 2N, ... for
    `every_n_iter=N`, counted in steps whatever `steps_per_dispatch` is (TF counted
    runs from each session's start), or every `every_n_secs` seconds. Values are read
    one run late (no device wait). With `reduce="mean"` (the
    default) a fetch given by name or callable is logged as its mean over the steps
    since the previous line, accumulated on the device (see `jm.Mean`); a reduction
    (`jm.Ratio("loss_sum", "tokens")`, `.then(np.exp)`) covers the same steps. The
    line at step N covers steps 1..N (the starting point's does not end a window), so
    `every_n_iter=epoch_size` logs TF's per-epoch means. Values
    print with 5 significant digits.

    Args:
      fetches: what to log: a dict `{tag: name, fn(state, batch, outputs) or
        jm.Reduction}` (logged in sorted tag order), or a list of output names (in the
        given order).
      every_n_iter, every_n_secs: the period; give exactly one, unless `at_end` alone.
      at_end: also log the values on the final state at `end` (the last step's
        values, not means).
      formatter: `formatter(values: dict) -> str`, or `formatter(values, step=...)`
        to get the step after the logged run too; the default is `"step N: tag =
        value, ..."` with the seconds since the previous line (none on a session's first).
      reduce: "mean" (default) or "last" (TF's value of the logged step) for fetches
        given by name or callable.
      on_error: "raise" (default) or "warn" (keep training if logging fails).

    Example:
      >>> import jaxmon as jm, numpy as np
      >>> hook = jm.LoggingHook({"loss": jm.Ratio("loss_sum", "tokens"),
      ...                        "ppl": jm.Ratio("loss_sum", "tokens").then(np.exp)}, every_n_iter=100)
    """

    def __init__(self, fetches: Any, every_n_iter: int | None = None, every_n_secs: float | None = None,
                 at_end: bool = False, formatter: Callable[[dict[str, Any]], str] | None = None,
                 reduce: str = "mean", *, on_error: str = "raise", clock: Callable[[], float] = time.monotonic):
        self.timer = timer_for(
            "LoggingHook", clock, at_end=at_end, first=True, every_n_iter=every_n_iter, every_n_secs=every_n_secs,
            error=("either at_end and/or exactly one of every_n_iter and every_n_secs must be provided (got "
                   f"every_n_iter={every_n_iter!r}, every_n_secs={every_n_secs!r}, at_end={at_end!r})."),
            steps_error=f"invalid every_n_iter={every_n_iter!r}: it must be an int >= 1.")
        if formatter is not None and not callable(formatter):
            raise TypeError(f"LoggingHook formatter must be a function formatter(values) -> str; got {formatter!r}.")
        self._formatter_takes_step = formatter is not None and _takes_step(formatter)
        if isinstance(fetches, Reduction):
            fetches = {"value": fetches}
        given = {tag: spec for tag, spec in fetches.items() if isinstance(spec, Reduction)} \
            if isinstance(fetches, Mapping) else {}
        plain = {tag: spec for tag, spec in fetches.items() if tag not in given} \
            if isinstance(fetches, Mapping) else fetches
        self._fetches = _fetches.normalize(plain, "LoggingHook fetches") or {}
        if not self._fetches and not given:
            raise ValueError(f"LoggingHook needs something to log: an output name, a list, or a dict; got {fetches!r}.")
        self._tags = sorted(fetches) if isinstance(fetches, Mapping) else list(self._fetches)
        self.at_end, self.formatter, self.reduce = at_end, formatter, check_reduce("LoggingHook", reduce)
        # Reduced on the device: the reductions given, and with "mean" every callable and
        # the scalar outputs named (one `Mean` of them; other names log their value).
        self._names = {tag: spec for tag, spec in self._fetches.items() if isinstance(spec, str)}
        if reduce == "mean":
            given |= {tag: Mean(spec) for tag, spec in self._fetches.items() if not isinstance(spec, str)}
        accumulators = {f"tag:{tag}": reduction for tag, reduction in given.items()}
        if reduce == "mean" and self._names:
            accumulators["names"] = Mean(sorted(set(self._names.values())))
        if accumulators:
            self.accumulators = accumulators
        self._read = {tag: spec for tag, spec in self._fetches.items() if tag not in given}
        self._reductions = given
        self.on_error = check_on_error("LoggingHook", on_error)
        self._start: int | None = None
        self._elapsed: dict[int, float | None] = {}

    def begin(self) -> None:
        show_info_logs()
        self.timer.reset()
        self._elapsed.clear()

    def after_create_session(self, session) -> None:
        self._start, self._timed = session.step, False
        self.timer.start(session.step)

    def next_trigger(self, step: int) -> Trigger | None:
        return self.timer.next_trigger(step)

    def before_run(self, ctx: RunContext) -> RunArgs | None:
        if not self.timer.should_trigger_for_step(ctx.next_step):
            return None
        restart = not self.timer.opening(ctx.next_step)  # the line after step 1: the next one's mean covers it
        elapsed = self.timer.update_last_triggered_step(ctx.next_step)[0]
        self._elapsed[ctx.step], self._timed = elapsed if self._timed else None, True  # the first line: no timing
        return RunArgs(fetches=dict(self._read), late=True, read=bool(self.accumulators), restart=restart)

    @report_thread.reports  # on the report thread: the loop only queues it
    def after_run(self, ctx: RunContext, values: RunValues) -> None:
        if values.results is None:
            return
        accumulated = values.accumulated or {}
        means = accumulated.get("names", {})
        logged = {tag: means.get(name, values.results.get(tag)) for tag, name in self._names.items()}
        logged |= {tag: values.results[tag] for tag in self._read if tag not in self._names}
        logged |= {tag: accumulated[f"tag:{tag}"] for tag in self._reductions}
        self._log(logged, self._elapsed.pop(ctx.step, None), values.step)

    def end(self, session) -> None:
        if self.at_end and self._start is not None and session.step > self._start:
            values = session.fetch(dict(self._fetches)) if self._fetches else {}
            for tag, reduction in self._reductions.items():
                values[tag] = of_last_step(reduction, session)
            self._log(values, None, session.step)

    def _log(self, values: dict[str, Any], elapsed: float | None, step: int) -> None:
        if self.formatter is not None:
            text = self.formatter(values, step=step) if self._formatter_takes_step else self.formatter(values)
            logger.info("%s", text)
            return
        line = ", ".join(f"{tag} = {shown(values[tag])}" for tag in self._tags)
        if elapsed is None:
            logger.info("step %d: %s", step, line)
        else:
            logger.info("step %d: %s (%.3f sec)", step, line, elapsed)

    def __repr__(self) -> str:
        return f"LoggingHook({self._tags!r}, {self.timer!r})"


def shown(value: Any) -> str:
    """A value as a log line shows it: floats with 5 significant digits (`0.92547`,
    `1.2346e-05`), arrays element by element, anything else as `str`.

    Example:
      >>> shown(0.9254687428474426), shown(np.float32(3)), shown(np.array([1 / 3, 2.0])), shown(7)
      ('0.92547', '3', '[0.33333 2]', '7')
    """
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{k}: {shown(v)}" for k, v in value.items()) + "}"
    array = np.asarray(value)
    if array.dtype.kind != "f":
        return str(value)
    if array.ndim == 0:
        return f"{float(array):.5g}"
    return np.array2string(array, formatter={"float_kind": lambda x: f"{x:.5g}"})


def _takes_step(formatter: Callable[..., str]) -> bool:
    """Whether `formatter` accepts a `step=` keyword (TF's took the values alone)."""
    try:
        parameters = inspect.signature(formatter).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.name == "step" or p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)


LoggingTensorHook = LoggingHook
