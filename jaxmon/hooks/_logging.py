"""Hooks that report progress: logged values, the step rate, a progress bar."""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Callable, Mapping
from typing import Any, TextIO

import jax
import numpy as np

from jaxmon import _fetches
from jaxmon._errors import check_int, check_on_error
from jaxmon._hook import Hook, RunArgs, RunContext, RunValues
from jaxmon._summary import WriterSlot
from jaxmon._triggers import timer_for
from jaxmon.hooks._stop import StopAtStepHook

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


class LoggingHook(Hook):
    """Logs fetched values every N local iterations or seconds, and/or at the end
    (TF's `LoggingTensorHook`), under the `jaxmon` logger at INFO.

    Values are read one run late (no device wait). Iterations are counted from 0 in
    each session, so `every_n_iter=10` logs iterations 0, 10, 20, ...

    Args:
      fetches: what to log: a dict `{tag: name or fn(state, batch, outputs)}` (logged
        in sorted tag order), or a list of output names (in the given order).
      every_n_iter, every_n_secs: the period; give exactly one, unless `at_end` alone.
      at_end: also log the values on the final state at `end`.
      formatter: `formatter(values: dict) -> str`; the default is
        `"tag = value, ..."` with the seconds since the previous line.
      on_error: "raise" (default) or "warn" (keep training if logging fails).

    Example:
      >>> import jaxmon as jm
      >>> hook = jm.LoggingHook(["loss", "accuracy"], every_n_iter=100)
    """

    def __init__(self, fetches: Any, every_n_iter: int | None = None, every_n_secs: float | None = None,
                 at_end: bool = False, formatter: Callable[[dict[str, Any]], str] | None = None, *,
                 on_error: str = "raise", clock: Callable[[], float] = time.monotonic):
        self.timer = timer_for(
            "LoggingHook", clock, at_end=at_end, every_n_iter=every_n_iter, every_n_secs=every_n_secs,
            error=("either at_end and/or exactly one of every_n_iter and every_n_secs must be provided (got "
                   f"every_n_iter={every_n_iter!r}, every_n_secs={every_n_secs!r}, at_end={at_end!r})."),
            steps_error=f"invalid every_n_iter={every_n_iter!r}: it must be an int >= 1.")
        if formatter is not None and not callable(formatter):
            raise TypeError(f"LoggingHook formatter must be a function formatter(values) -> str; got {formatter!r}.")
        self._fetches = _fetches.normalize(fetches, "LoggingHook fetches")
        if not self._fetches:
            raise ValueError(f"LoggingHook needs something to log: an output name, a list, or a dict; got {fetches!r}.")
        self._tags = sorted(self._fetches) if isinstance(fetches, Mapping) else list(self._fetches)
        self.at_end, self.formatter = at_end, formatter
        self.on_error = check_on_error("LoggingHook", on_error)
        self._iter_count = 0
        self._elapsed: dict[int, float | None] = {}

    def begin(self) -> None:
        show_info_logs()
        self.timer.reset()
        self._iter_count = 0
        self._elapsed.clear()

    def get_state(self) -> dict[str, Any]:
        return {**super().get_state(), "iter_count": self._iter_count}

    def set_state(self, state: dict[str, Any]) -> None:
        super().set_state(state)
        self._iter_count = state["iter_count"]

    def steps_to_next_trigger(self, step: int) -> int | None:
        return None  # it counts runs (iterations), as TF's LoggingTensorHook did, not steps

    def before_run(self, ctx: RunContext) -> RunArgs | None:
        iteration, self._iter_count = self._iter_count, self._iter_count + 1
        if not self.timer.should_trigger_for_step(iteration):
            return None
        self._elapsed[ctx.step] = self.timer.update_last_triggered_step(iteration)[0]
        return RunArgs(fetches=self._fetches, late=True)

    def after_run(self, ctx: RunContext, values: RunValues) -> None:
        if values.results is not None:
            self._log(values.results, self._elapsed.pop(ctx.step, None))

    def end(self, session) -> None:
        if self.at_end and self._iter_count:
            self._log(session.fetch(self._fetches), None)

    def _log(self, values: dict[str, Any], elapsed: float | None) -> None:
        if self.formatter is not None:
            logger.info("%s", self.formatter(values))
            return
        with np.printoptions(suppress=True):
            line = ", ".join(f"{tag} = {values[tag]}" for tag in self._tags)
        logger.info("%s (%.3f sec)" if elapsed is not None else "%s", line, *(() if elapsed is None else (elapsed,)))

    def __repr__(self) -> str:
        return f"LoggingHook({self._tags!r}, {self.timer!r})"


LoggingTensorHook = LoggingHook


class StepCounterHook(Hook):
    """Writes and logs the training speed, `global_step/sec`, every N steps or seconds.

    The first trigger only starts the clock (nothing is written for it), so with
    `every_n_steps=100` rates appear at steps 101, 201, ... With a known batch size
    (given, or the common leading dimension of the batch's arrays) it also writes
    `examples/sec`. Rates are measured on the host at step boundaries; the host runs at
    most a few steps ahead of the device, so over a period they match the device.

    Args:
      every_n_steps, every_n_secs: the period; give exactly one (pass
        `every_n_steps=None` with `every_n_secs`).
      output_dir: a directory to write to (shared with other hooks writing there), or
      summary_writer: a writer; with neither, the hook only logs.
      batch_size: examples per step, when it cannot be read off the batch.
      on_error: "raise" (default) or "warn".

    Example:
      >>> import jaxmon as jm
      >>> hook = jm.StepCounterHook(every_n_steps=100, output_dir="runs/example")
    """

    def __init__(self, every_n_steps: int | None = 100, every_n_secs: float | None = None,
                 output_dir: str | os.PathLike | None = None, summary_writer: Any = None, *,
                 batch_size: int | None = None, tag: str = "global_step/sec", on_error: str = "raise",
                 clock: Callable[[], float] = time.monotonic):
        self.timer = timer_for(
            "StepCounterHook", clock, every_n_steps=every_n_steps, every_n_secs=every_n_secs,
            error=("exactly one of every_n_steps and every_n_secs should be provided (got "
                   f"every_n_steps={every_n_steps!r}, every_n_secs={every_n_secs!r}; every_n_steps defaults to "
                   "100, so pass every_n_steps=None with every_n_secs)."))
        if batch_size is not None:
            check_int("StepCounterHook batch_size", batch_size, minimum=1)
        self._slot = WriterSlot("StepCounterHook", output_dir, summary_writer, required=False)
        self.batch_size, self.tag = batch_size, tag
        self.on_error = check_on_error("StepCounterHook", on_error)
        self._last_step: int | None = None
        self._warnings = 0

    def begin(self) -> None:
        show_info_logs()
        self._slot.open()

    def after_create_session(self, session) -> None:
        self.timer.reset()  # a restored or recovered step starts a new interval
        self._last_step = None

    def after_run(self, ctx: RunContext, values: RunValues) -> None:
        step = values.step
        if self._last_step is not None and step <= self._last_step and self._warnings < 5:
            self._warnings += 1
            logger.warning("It seems that the global step has not been increased: it went from %d to %d. "
                           "Rates skip such runs.", self._last_step, step)
        self._last_step = step
        if not self.timer.should_trigger_for_step(step):
            return
        elapsed_secs, elapsed_steps = self.timer.update_last_triggered_step(step)
        if not elapsed_secs or elapsed_steps <= 0:
            return  # the first trigger only starts the clock
        rate = elapsed_steps / elapsed_secs
        scalars = {self.tag: rate}
        batch_size = self.batch_size or _batch_size(ctx.original_args.feeds)
        if batch_size:
            scalars["examples/sec"] = rate * batch_size
        logger.info("%s: %g", self.tag, rate)
        if self._slot.writer is not None:
            self._slot.writer.write_scalars(step, scalars)

    def close(self) -> None:
        self._slot.close()

    def __repr__(self) -> str:
        return f"StepCounterHook({self.timer!r})"


def _batch_size(batch: Any) -> int | None:
    """The leading dimension shared by every array of the batch, if there is one."""
    sizes = {np.shape(leaf)[0] if np.ndim(leaf) else None for leaf in jax.tree.leaves(batch)}
    return sizes.pop() if len(sizes) == 1 else None


class ProgressBarHook(Hook):
    """A one-line progress bar: step, steps/sec, ETA and the latest values.

    Quiet (prints nothing) when `stream` is not a terminal or the `CI` environment
    variable is set, unless `enabled=True`. Values are read one run late, at most
    every `every_n_secs`, from the step's outputs by name (names it lacks are skipped).

    Args:
      total_steps: the last step; None takes it from a `StopAtStepHook` of the session.
      fetches: output names to show.
      every_n_secs: refresh period.
      stream: where to draw (default `sys.stderr`).
      enabled: force on or off; None decides from the terminal and `CI`.

    Example:
      >>> import jaxmon as jm
      >>> hook = jm.ProgressBarHook(total_steps=10_000)
    """

    def __init__(self, total_steps: int | None = None, fetches: tuple[str, ...] | list[str] = ("loss",), *,
                 every_n_secs: float = 0.2, stream: TextIO | None = None, enabled: bool | None = None,
                 width: int = 24, on_error: str = "warn", clock: Callable[[], float] = time.monotonic):
        if total_steps is not None:
            check_int("ProgressBarHook total_steps", total_steps, minimum=1)
        if isinstance(fetches, str) or not all(isinstance(name, str) for name in fetches):
            raise ValueError(f"ProgressBarHook fetches must be a list of output names; got {fetches!r}.")
        self.timer = timer_for("ProgressBarHook", clock, every_n_steps=None, every_n_secs=every_n_secs,
                               error=f"ProgressBarHook every_n_secs must be a number >= 0; got {every_n_secs!r}.")
        self.total_steps, self.fetches = total_steps, tuple(fetches)
        self._stream, self._enabled, self._width = stream, enabled, width
        self.on_error = check_on_error("ProgressBarHook", on_error)
        self._clock = clock
        self._start: tuple[int, float] | None = None
        self._total: int | None = None
        self._drawn = False

    def begin(self) -> None:
        stream = self._stream or sys.stderr
        self.enabled = self._enabled if self._enabled is not None else (
            getattr(stream, "isatty", lambda: False)() and not os.environ.get("CI"))
        self.timer.reset()
        self._drawn = False

    def after_create_session(self, session) -> None:
        self._start = (session.step, self._clock())
        self._total = self.total_steps
        if self._total is None:
            stops = [hook.last_step for hook in session.hooks if isinstance(hook, StopAtStepHook)]
            self._total = min((s for s in stops if s is not None), default=None)

    def before_run(self, ctx: RunContext) -> RunArgs | None:
        if not self.enabled or not self.timer.due(ctx.next_step):
            return None
        return RunArgs(fetches={}, late=True)

    def after_run(self, ctx: RunContext, values: RunValues) -> None:
        if values.results is not None:  # a refresh this hook asked for
            shown = {name: values.outputs[name] for name in self.fetches if name in values.outputs}
            self._draw(values.step, jax.device_get(shown))

    def _draw(self, step: int, shown: dict[str, Any]) -> None:
        start_step, start_time = self._start
        elapsed = max(self._clock() - start_time, 1e-9)
        rate = (step - start_step) / elapsed
        parts = [f"step {step}" + (f"/{self._total}" if self._total else "")]
        if self._total:
            done = min(step / self._total, 1.0)
            filled = int(done * self._width)
            parts.insert(0, f"[{'#' * filled}{'.' * (self._width - filled)}] {done:6.1%}")
            if rate > 0:
                parts.append(f"ETA {_clock_time(max(self._total - step, 0) / rate)}")
        parts.append(f"{rate:.1f} steps/s")
        parts += [f"{name} {np.asarray(value).item():.4g}" for name, value in shown.items() if np.size(value) == 1]
        stream = self._stream or sys.stderr
        stream.write("\r" + "  ".join(parts) + "\x1b[K")
        stream.flush()
        self._drawn = True

    def end(self, session) -> None:
        if self.enabled and session.step:
            self._draw(session.step, {})

    def close(self) -> None:
        if self._drawn:
            (self._stream or sys.stderr).write("\n")
            self._drawn = False

    def __repr__(self) -> str:
        return f"ProgressBarHook(total_steps={self.total_steps})"


def _clock_time(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"
