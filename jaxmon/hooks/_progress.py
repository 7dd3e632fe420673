"""ProgressBarHook: a one-line progress bar with the step rate, ETA and latest values,
drawn with `rich` (installed with flax)."""

from __future__ import annotations

import io
import os
import sys
import time
from collections.abc import Callable, Mapping
from typing import Any, TextIO

import jax
import numpy as np

from jaxmon._base.errors import check_int, check_on_error
from jaxmon._base.hook import RunArgs, RunContext, RunValues
from jaxmon._base.timed import TimedHook
from jaxmon._base.triggers import Trigger, timer_for
from jaxmon._metrics.reductions import Mean, Reduction, check_reduce
from jaxmon.hooks._stop import StopAtStepHook
from jaxmon.hooks._throughput import Throughput


class ProgressBarHook(TimedHook):
    """A one-line progress bar: step, steps/sec, ETA and the latest values.

    Quiet (prints nothing) when `stream` is not a terminal or the `CI` environment
    variable is set, unless `enabled=True`. Values are read one run late, at most
    every `every_n_secs`, from the step's outputs by name (names it lacks are skipped):
    with `reduce="mean"` (default) each scalar's mean over the steps since the last
    refresh, accumulated on the device; with `"last"` its value at the refresh step. A
    reduction (`{"loss": jm.Ratio("loss_sum", "tokens")}`) covers the same steps. The
    last refresh, at the end, shows the steps since the one before. In a
    `MonitoredTrainingSession` the bar also shows the latest `perf/*` figures: tokens
    (or examples) per second, TFLOP/s per device and MFU, where they are known.

    Args:
      total_steps: the last step; None takes it from a `StopAtStepHook` of the session.
      fetches: output names to show, or a dict `{tag: name or jm.Reduction}`.
      every_n_secs: refresh period.
      stream: where to draw (default `sys.stderr`).
      enabled: force on or off; None decides from the terminal and `CI`.

    Example:
      >>> import jaxmon as jm
      >>> hook = jm.ProgressBarHook(total_steps=10_000)
    """

    def __init__(self, total_steps: int | None = None,
                 fetches: tuple[str, ...] | list[str] | Mapping[str, Any] = ("loss",), *,
                 every_n_secs: float = 0.2, stream: TextIO | None = None, enabled: bool | None = None,
                 width: int = 24, reduce: str = "mean", on_error: str = "warn",
                 clock: Callable[[], float] = time.monotonic):
        if total_steps is not None:
            check_int("ProgressBarHook total_steps", total_steps, minimum=1)
        named = fetches.items() if isinstance(fetches, Mapping) else None
        if named is None and (isinstance(fetches, str) or not all(isinstance(name, str) for name in fetches)):
            raise ValueError(f"ProgressBarHook fetches must be a list of output names, or a dict {{tag: name or "
                             f"jm.Reduction}}; got {fetches!r}.")
        if named is not None and not all(isinstance(spec, (str, Reduction)) for _, spec in named):
            raise ValueError(f"ProgressBarHook fetches must be a list of output names, or a dict {{tag: name or "
                             f"jm.Reduction}}; got {fetches!r}.")
        self.timer = timer_for("ProgressBarHook", clock, every_n_steps=None, every_n_secs=every_n_secs,
                               error=f"ProgressBarHook every_n_secs must be a number >= 0; got {every_n_secs!r}.")
        self.total_steps = total_steps
        self._specs = dict(named) if named is not None else {name: name for name in fetches}
        self.fetches = tuple(self._specs)
        self._stream, self._enabled, self._width = stream, enabled, width
        self.on_error = check_on_error("ProgressBarHook", on_error)
        self._clock = clock
        self._start: tuple[int, float] | None = None
        self._total: int | None = None
        self._drawn, self._console = False, None  # the console that renders the bar (on the first draw)
        self._perf: Throughput | None = None  # the session's `perf/*` service, if it has one
        self._shown: dict[str, Any] = {}
        self._refreshed: int | None = None
        self.reduce = check_reduce("ProgressBarHook", reduce)
        accumulators = {f"tag:{tag}": spec for tag, spec in self._specs.items() if isinstance(spec, Reduction)}
        names = sorted({spec for spec in self._specs.values() if isinstance(spec, str)})
        if reduce == "mean" and names:  # quiet too: every process of a run compiles the same step
            accumulators["mean"] = Mean(names)
        if accumulators:
            self.accumulators = accumulators

    def begin(self) -> None:
        stream = self._stream or sys.stderr
        self.enabled = self._enabled if self._enabled is not None else (
            getattr(stream, "isatty", lambda: False)() and not os.environ.get("CI"))
        self.timer.reset()
        self._drawn, self._shown, self._console = False, {}, None

    def after_create_session(self, session) -> None:
        self._start = (session.step, self._clock())
        self._refreshed = session.step
        self.timer.start(session.step)
        self._total = self.total_steps
        self._perf = next((hook for hook in session.hooks if isinstance(hook, Throughput)), None)
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
            self._refreshed = values.step
            self._draw(values.step, self._values(values.outputs, values.accumulated))

    def after_read(self, step: int, values: dict[str, Any]) -> None:
        if self.enabled and self._refreshed is not None and step > self._refreshed:  # a read at a save or the end
            self._shown = self._values(self._shown, values)

    def _values(self, outputs: Mapping[str, Any], accumulated: dict[str, Any] | None) -> dict[str, Any]:
        accumulated = accumulated or {}
        means = accumulated.get("mean", {})
        shown = {}
        for tag, spec in self._specs.items():
            if isinstance(spec, Reduction):
                shown[tag] = accumulated.get(f"tag:{tag}", outputs.get(tag))
            elif spec in means:
                shown[tag] = means[spec]
            elif spec in outputs:
                shown[tag] = outputs[spec]
        return {tag: value for tag, value in jax.device_get(shown).items() if value is not None}

    def _draw(self, step: int, shown: dict[str, Any]) -> None:
        start_step, start_time = self._start
        elapsed = max(self._clock() - start_time, 1e-9)
        rate = (step - start_step) / elapsed
        parts = [f"step {step}" + (f"/{self._total}" if self._total else "")]
        if self._total and rate > 0:
            parts.append(f"ETA {_clock_time(max(self._total - step, 0) / rate)}")
        parts.append(f"{rate:.1f} steps/s")
        parts += [f"{name} {np.asarray(value).item():.4g}" for name, value in shown.items() if np.size(value) == 1]
        parts += _perf_parts(self._perf.figures if self._perf is not None else {})
        stream = self._stream or sys.stderr
        stream.write("\r" + self._line(step, "  ".join(parts), stream) + "\x1b[K")
        stream.flush()
        self._drawn, self._shown = True, shown

    def _line(self, step: int, text: str, stream: TextIO) -> str:
        """The bar (a `rich` progress bar and its percentage, when the total is known) and
        `text` as one line: the bar in colour on a terminal, plain elsewhere."""
        if not self._total:
            return text
        from rich.console import Console
        from rich.progress_bar import ProgressBar

        if self._console is None:  # one per session: a draw renders the bar only
            terminal = getattr(stream, "isatty", lambda: False)()
            self._console = Console(file=io.StringIO(), width=self._width, force_terminal=terminal,
                                    color_system="auto" if terminal else None)
        bar = ProgressBar(total=self._total, completed=min(step, self._total), width=self._width)
        with self._console.capture() as captured:
            self._console.print(bar, end="")
        return f"{captured.get()}  {min(step / self._total, 1.0):6.1%}  {text}"

    def end(self, session) -> None:
        if self.enabled and session.step:  # the metrics of the last read (the session's close reads them)
            self._draw(session.step, self._shown)

    def close(self) -> None:
        if self._drawn:
            (self._stream or sys.stderr).write("\n")
            self._drawn = False

    def __repr__(self) -> str:
        return f"ProgressBarHook(total_steps={self.total_steps})"


def _perf_parts(figures: Mapping[str, float]) -> list[str]:
    """The bar's words for the `perf/*` figures: tokens (else examples) per second,
    TFLOP/s per device and MFU, those known."""
    parts = []
    if "perf/tokens_per_sec" in figures:
        parts.append(f"{figures['perf/tokens_per_sec']:.4g} tokens/s")
    elif "perf/examples_per_sec" in figures:
        parts.append(f"{figures['perf/examples_per_sec']:.4g} examples/s")
    if "perf/tflops_per_sec_per_device" in figures:
        parts.append(f"{figures['perf/tflops_per_sec_per_device']:.3g} TFLOP/s")
    if "perf/mfu" in figures:
        parts.append(f"MFU {figures['perf/mfu']:.1%}")
    return parts


def _clock_time(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"
