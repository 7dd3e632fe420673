"""Throughput (`perf/*` summaries, one of `MonitoredTrainingSession`'s services): steps,
examples and tokens per second, TFLOP/s per device and MFU against the device's peak.

A step's FLOPs are the caller's (`flops_per_step`; `jaxmon train` gives the built-in
LM's model count), else counted once by `step_flops` (XLA's count of the step with every
loop counted by its trip count), on a thread of its own from the end of the first run:
the loop does not wait for it. That count is of the step function lowered on the
session's state and one step's batch, as XLA's HLO has it before its optimisations: the
model's forward and backward pass and the optimizer's update, without what jaxmon adds
to the step (its accumulators). Attention is counted as computed: a causal mask does not
halve the count (MaxText's newer MFU halves it; the two do not compare). A figure that
cannot be computed is said once in the log, with why and what to give instead.
"""

from __future__ import annotations

import logging
import math
import numbers
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from jaxmon._base.abstract import abstract, one_step
from jaxmon._base.hook import RunContext, RunValues
from jaxmon._base.timed import TimedHook
from jaxmon._base.triggers import Trigger, timer_for
from jaxmon._ops.flops import StepFlops, step_flops
from jaxmon._writers import WriterSlot

logger = logging.getLogger("jaxmon")

#: Dense bfloat16 peak TFLOP/s per device, the vendors' figures, by a word of the device's
#: kind (`jax.devices()[0].device_kind`); `peak_tflops=` (`perf.peak_tflops` in a config) overrides it.
PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0, "TPU v4": 275.0, "TPU v5 lite": 197.0,
               "TPU v5e": 197.0, "TPU v5p": 459.0, "TPU v6 lite": 918.0, "TPU v6e": 918.0}

#: What each figure `Throughput` takes is, for the errors that name one.
FIGURES = {"peak_tflops": "the dense peak TFLOP/s of one device",
           "flops_per_step": "the FLOPs of one step, all devices together",
           "examples_per_step": "the examples of one step, all processes together",
           "tokens_per_step": "the tokens of one step, all processes together"}

#: Where a user gives a figure jaxmon cannot compute: the session's argument, or the config's key.
_GIVE = "give {0}= to MonitoredTrainingSession (perf.{0} in a jaxmon config)"


def peak_tflops(device_kind: str) -> float | None:
    """The peak of `PEAK_TFLOPS` whose key `device_kind` contains (None: not listed)."""
    return next((peak for name, peak in PEAK_TFLOPS.items() if name in device_kind), None)


def check_figures(owner: str, **figures: Any) -> None:
    """Raises a `TypeError` or `ValueError` naming `owner`'s argument unless each of
    `figures` (named in `FIGURES`) is None or a finite number > 0."""
    for name, value in figures.items():
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise TypeError(f"{owner} {name} must be a number > 0 ({FIGURES[name]}) or None; got {value!r} of type "
                            f"{type(value).__name__}.")
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"{owner} {name} must be a finite number > 0 ({FIGURES[name]}) or None; got {value!r}.")


class Throughput(TimedHook):
    """Writes `perf/*` at the summary cadence: `steps_per_sec`, `examples_per_sec`,
    `tokens_per_sec` (where the step's tokens are known), `tflops_per_sec_per_device`
    (where the step's FLOPs are known) and `mfu` (where the device's peak is known too).
    Rates are over the steps since the last write, timed on the host at step boundaries
    (the first from the end of the first run, which compiles). A figure that cannot be
    computed is said once in the log, with why.

    Args:
      step_fn: the session's step, whose FLOPs are counted once (`step_flops`).
      flops_per_step: FLOPs a step, all devices together, or `fn(state, batch)` giving
        them from the abstract state and one step's batch; None: `step_flops`' count.
      examples_per_step: examples a step, all processes together; None: the rows of one
        step's batch (its first leaf's leading axis; times the processes where each
        process feeds its own rows).
      tokens_per_step: tokens a step, all processes together (None: not counted).
      peak_tflops: the peak TFLOP/s of one device (None: `PEAK_TFLOPS` by the device's kind).
      every_n_steps, every_n_secs: the period.
      output_dir: where the summaries go (with the run's other summaries).
      log: also log each write as one line.

    `figures` holds the last write's values by tag (`ProgressBarHook` shows them).
    """

    def __init__(self, step_fn: Callable[..., Any], *,
                 flops_per_step: float | Callable[[Any, Any], float] | None = None,
                 examples_per_step: float | None = None, tokens_per_step: float | None = None,
                 peak_tflops: float | None = None, every_n_steps: int | None = 100, every_n_secs: float | None = None,
                 output_dir: str | os.PathLike | None = None, log: bool = False,
                 clock: Callable[[], float] = time.monotonic):
        given = {} if callable(flops_per_step) else {"flops_per_step": flops_per_step}
        check_figures("Throughput", examples_per_step=examples_per_step, tokens_per_step=tokens_per_step,
                      peak_tflops=peak_tflops, **given)
        self.timer = timer_for("perf", clock, every_n_steps=every_n_steps, every_n_secs=every_n_secs)
        self._step_fn, self._examples, self._tokens = step_fn, examples_per_step, tokens_per_step
        self._flops_of = flops_per_step if callable(flops_per_step) else None
        self._flops = None if callable(flops_per_step) else flops_per_step
        self._peak, self._log = peak_tflops, log
        self._slot = WriterSlot("perf", output_dir, None, required=False)
        self._started = False  # a run since the session was created (its first, which compiles, starts the clock)
        self._settled = False  # the figures that do not change were found, once per session (a recovery keeps them)
        self._counting: threading.Thread | None = None  # counts the step's FLOPs, from the first run on
        self.figures: dict[str, float] = {}  # the last write's `perf/*` values

    def begin(self) -> None:
        self._slot.open()

    def after_create_session(self, session: Any) -> None:
        self._slot.restarted(session)
        self.timer.reset()
        self._started = False

    def next_trigger(self, step: int) -> Trigger | None:
        return self.timer.next_trigger(step) if self._started else Trigger(step + 1)

    def after_run(self, ctx: RunContext, values: RunValues) -> None:
        if not self._started:  # the run that compiled: the clock starts after it
            self._started = True
            self.timer.start(values.step)
            if not self._settled:
                self._settle(ctx)
            return
        if not self.timer.should_trigger_for_step(values.step):
            return
        rate = self.timer.rate(values.step)
        if self._counting is not None:
            self._counting.join()  # begun a period ago: done by now, but for a step that lowers slowly
        if rate is not None:
            self._write(values.step, rate)

    def _settle(self, ctx: RunContext) -> None:
        """Finds the figures of a step the caller did not give (each said once where it
        cannot be found), and starts counting its FLOPs."""
        self._settled = True
        batch = one_step(ctx.original_args.feeds, ctx.steps)
        if self._examples is None:
            self._examples = _rows(batch)
        if self._peak is None:
            self._peak = _device_peak()
        if self._flops is None:
            self._counting = threading.Thread(target=self._count, args=(abstract(ctx.session.state), batch),
                                              name="jaxmon-perf-flops", daemon=True)
            self._counting.start()

    def _count(self, state: Any, batch: Any) -> None:
        """The step's FLOPs: the caller's function of the state and batch, else `step_flops`';
        None, said once, where they cannot be counted (no TFLOP/s, no MFU)."""
        try:
            if self._flops_of is not None:
                self._flops = float(self._flops_of(state, batch))
            else:
                self._flops = _said(step_flops(self._step_fn, state, batch))
        except Exception as error:  # noqa: BLE001 - a metric: training goes on without it
            logger.warning("perf: no TFLOP/s or MFU: counting the step's FLOPs failed (%s: %s); %s.",
                           type(error).__name__, " ".join(str(error).split())[:300], _GIVE.format("flops_per_step"))

    def _write(self, step: int, rate: float) -> None:
        scalars = {"perf/steps_per_sec": rate}
        if self._examples:
            scalars["perf/examples_per_sec"] = rate * self._examples
        if self._tokens:
            scalars["perf/tokens_per_sec"] = rate * self._tokens
        if self._flops is not None:
            tflops = self._flops * rate / jax.device_count() / 1e12
            scalars["perf/tflops_per_sec_per_device"] = tflops
            if self._peak:
                scalars["perf/mfu"] = tflops / self._peak
        self.figures = scalars
        if self._log:
            logger.info("perf at step %d: %s", step, ", ".join(f"{k.removeprefix('perf/')} {v:.4g}"
                                                               for k, v in scalars.items()))
        if self._slot.writer is not None:
            self._slot.writer.write_scalars(step, scalars)

    def close(self) -> None:
        self._slot.close()

    def __repr__(self) -> str:
        return f"Throughput({self.timer!r})"


def _said(counted: StepFlops) -> float | None:
    """`counted`'s FLOPs, having said once what the count could not do."""
    if counted.flops is None:
        logger.warning("perf: no TFLOP/s or MFU: %s; %s.", counted.why, _GIVE.format("flops_per_step"))
        return None
    if counted.platform != jax.default_backend():
        logger.info("perf: XLA gives no FLOP count on %s before compiling; the step's FLOPs are its count of the step "
                    "lowered for the %s.", jax.default_backend(), counted.platform.upper())
    if counted.counted_once:
        logger.warning("perf: %d loop(s) of the step are counted once, not by their trip count (a while_loop's is "
                       "known only as it runs; a scan whose body does not lower alone, as in a shard_map, keeps XLA's "
                       "count): TFLOP/s and MFU are low; for the true figures %s.", counted.counted_once,
                       _GIVE.format("flops_per_step"))
    return counted.flops


def _device_peak() -> float | None:
    """The peak TFLOP/s of this process's first device by its kind; None said once (on a CPU
    as a note, elsewhere as a warning)."""
    device = jax.devices()[0]
    peak = peak_tflops(device.device_kind)
    if peak is None:
        logger.log(logging.INFO if device.platform == "cpu" else logging.WARNING,
                   "perf: no MFU: jaxmon's table of peaks (%s) has none for the device kind %r; %s.",
                   ", ".join(PEAK_TFLOPS), device.device_kind, _GIVE.format("peak_tflops"))
    return peak


def shared_rows(batch: Any) -> int | None:
    """The leading dimension every array of one step's `batch` shares: its examples (None
    when the arrays disagree or one has no leading axis)."""
    sizes = {np.shape(leaf)[0] if np.ndim(leaf) else None for leaf in jax.tree.leaves(batch)}
    return sizes.pop() if len(sizes) == 1 else None


def _rows(batch: Any) -> int | None:
    """The examples of one step's abstract `batch` (`shared_rows`), times the processes where
    each feeds its own rows (host arrays: no sharding); None, said once, for a batch
    without them."""
    rows = shared_rows(batch)
    if rows is None:
        shapes = ", ".join(f"{leaf.dtype}{list(np.shape(leaf))}" for leaf in jax.tree.leaves(batch)[:4]) or "none"
        logger.info("perf: no examples per second: the step's arrays share no leading axis (%s); %s.",
                    shapes, _GIVE.format("examples_per_step"))
        return None
    first = jax.tree.leaves(batch)[0]
    return rows if getattr(first, "sharding", None) is not None else rows * jax.process_count()
