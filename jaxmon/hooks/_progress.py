"""ProgressBarHook: a one-line progress bar with the step rate, ETA and latest values."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from typing import Any, TextIO

import jax
import numpy as np

from jaxmon._errors import check_int, check_on_error
from jaxmon._hook import RunArgs, RunContext, RunValues
from jaxmon._metrics import Mean, check_reduce
from jaxmon._triggers import Trigger, timer_for
from jaxmon.hooks._stop import StopAtStepHook
from jaxmon.hooks._timed import TimedHook


class ProgressBarHook(TimedHook):
    """A one-line progress bar: step, steps/sec, ETA and the latest values.

    Quiet (prints nothing) when `stream` is not a terminal or the `CI` environment
    variable is set, unless `enabled=True`. Values are read one run late, at most
    every `every_n_secs`, from the step's outputs by name (names it lacks are skipped):
    with `reduce="mean"` (default) each scalar's mean over the steps since the last
    refresh, accumulated on the device; with `"last"` its value at the refresh step.

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
                 width: int = 24, reduce: str = "mean", on_error: str = "warn",
                 clock: Callable[[], float] = time.monotonic):
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
        self.reduce = check_reduce("ProgressBarHook", reduce)
        if reduce == "mean" and self.fetches:  # quiet too: every process of a run compiles the same step
            self.accumulators = {"mean": Mean(list(self.fetches))}

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

    def next_trigger(self, step: int) -> Trigger | None:
        return self.timer.next_trigger(step) if self.enabled else Trigger()

    def before_run(self, ctx: RunContext) -> RunArgs | None:
        if not self.enabled or not self.timer.due(ctx.next_step):
            return None
        return RunArgs(fetches={}, late=True, read=bool(self.accumulators))

    def after_run(self, ctx: RunContext, values: RunValues) -> None:
        if values.results is not None:  # a refresh this hook asked for
            shown = {name: values.outputs[name] for name in self.fetches if name in values.outputs}
            if values.accumulated:
                shown |= values.accumulated["mean"]
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
