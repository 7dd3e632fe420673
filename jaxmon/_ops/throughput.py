"""Throughput (`perf/*` summaries, one of `MonitoredTrainingSession`'s services): steps,
examples and tokens per second, TFLOP/s per device from XLA's cost analysis of the step,
and MFU against the device's peak.

FLOPs are counted once, by XLA's cost analysis of the step function lowered on the
session's state and one step's batch (on a thread of its own, from the end of the first
run: the loop does not wait for it), as XLA's HLO has them before its optimisations:
the model's forward and backward pass and the optimizer's update, without what jaxmon
adds to the step (its accumulators). Attention is counted as computed: a causal mask
does not halve the count (MaxText's newer MFU halves it; the two do not compare).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from jaxmon._base.hook import RunContext, RunValues
from jaxmon._base.timed import TimedHook
from jaxmon._base.triggers import Trigger, timer_for
from jaxmon._run.batches import abstract, one_step
from jaxmon._writers import WriterSlot

logger = logging.getLogger("jaxmon")

#: Dense bfloat16 peak TFLOP/s per device, the vendors' figures, by a word of the device's
#: kind (`jax.devices()[0].device_kind`); `perf.peak_tflops` in a config overrides it.
PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0, "TPU v4": 275.0, "TPU v5 lite": 197.0,
               "TPU v5e": 197.0, "TPU v5p": 459.0, "TPU v6 lite": 918.0, "TPU v6e": 918.0}


def peak_tflops(device_kind: str) -> float | None:
    """The peak of `PEAK_TFLOPS` whose key `device_kind` contains (None: not listed)."""
    return next((peak for name, peak in PEAK_TFLOPS.items() if name in device_kind), None)


def step_flops(step_fn: Callable[..., Any], state: Any, batch: Any) -> float | None:
    """XLA's count of the floating-point operations of one `step_fn(state, batch)`, all
    devices together (None where XLA gives none); both may be abstract."""
    cost = jax.jit(step_fn).lower(state, batch).cost_analysis()
    flops = (cost[0] if isinstance(cost, list) else cost or {}).get("flops")
    return float(flops) if flops and flops > 0 else None


class Throughput(TimedHook):
    """Writes `perf/*` at the summary cadence: `steps_per_sec`, `examples_per_sec`,
    `tokens_per_sec` (where the step's tokens are known), `tflops_per_sec_per_device`
    (where XLA counts the step's FLOPs) and `mfu` (where the device's peak is known).
    Rates are over the steps since the last write, timed on the host at step boundaries
    (the first from the end of the first run, which compiles).

    Args:
      step_fn: the session's step, whose FLOPs XLA counts once.
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

    def __init__(self, step_fn: Callable[..., Any], *, examples_per_step: int | None = None,
                 tokens_per_step: int | None = None, peak_tflops: float | None = None,
                 every_n_steps: int | None = 100, every_n_secs: float | None = None,
                 output_dir: str | os.PathLike | None = None, log: bool = False,
                 clock: Callable[[], float] = time.monotonic):
        self.timer = timer_for("perf", clock, every_n_steps=every_n_steps, every_n_secs=every_n_secs)
        self._step_fn, self._examples, self._tokens = step_fn, examples_per_step, tokens_per_step
        self._peak, self._log = peak_tflops, log
        self._slot = WriterSlot("perf", output_dir, None, required=False)
        self._started = False  # a run since the session was created (its first, which compiles, starts the clock)
        self._counting: threading.Thread | None = None  # counts the step's FLOPs, from the first run on
        self._flops: float | None = None
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
            batch = one_step(ctx.original_args.feeds, ctx.steps)
            if self._examples is None:
                self._examples = _rows(batch)
            if self._counting is None:
                self._counting = threading.Thread(target=self._count, args=(abstract(ctx.session.state), batch),
                                                  name="jaxmon-perf-flops", daemon=True)
                self._counting.start()
            return
        if not self.timer.should_trigger_for_step(values.step):
            return
        secs, steps = self.timer.update_last_triggered_step(values.step)
        self._counting.join()  # begun a period ago: done by now, but for a step that lowers slowly
        if secs and steps > 0:
            self._write(values.step, steps / secs)

    def _count(self, state: Any, batch: Any) -> None:
        """The step's FLOPs; None, logged, where XLA cannot count them (no TFLOP/s, no MFU)."""
        try:
            self._flops = step_flops(self._step_fn, state, batch)
        except Exception as error:  # noqa: BLE001 - a metric: training goes on without it
            logger.warning("perf: XLA could not count the step's FLOPs (%r); no TFLOP/s or MFU.", error)

    def _write(self, step: int, rate: float) -> None:
        scalars = {"perf/steps_per_sec": rate}
        if self._examples:
            scalars["perf/examples_per_sec"] = rate * self._examples
        if self._tokens:
            scalars["perf/tokens_per_sec"] = rate * self._tokens
        if self._flops:
            tflops = self._flops * rate / jax.device_count() / 1e12
            scalars["perf/tflops_per_sec_per_device"] = tflops
            peak = self._peak or peak_tflops(jax.devices()[0].device_kind)
            if peak:
                scalars["perf/mfu"] = tflops / peak
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


def _rows(batch: Any) -> int | None:
    """The examples of one step's abstract `batch`: its first leaf's leading axis, times the
    processes where each feeds its own rows (host arrays: no sharding)."""
    leaves = jax.tree.leaves(batch)
    if not leaves or not np.shape(leaves[0]):
        return None
    rows = int(np.shape(leaves[0])[0])
    return rows if getattr(leaves[0], "sharding", None) is not None else rows * jax.process_count()
