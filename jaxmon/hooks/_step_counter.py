"""StepCounterHook: the training speed, written and logged every N steps or seconds."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import Any

from jaxmon._base.errors import check_int, check_on_error
from jaxmon._base.hook import RunContext, RunValues
from jaxmon._base.timed import TimedHook
from jaxmon._base.triggers import Trigger, timer_for
from jaxmon._ops import report_thread
from jaxmon._writers import WriterSlot
from jaxmon.hooks._logging import show_info_logs
from jaxmon.hooks._throughput import shared_rows

logger = logging.getLogger("jaxmon")


class StepCounterHook(TimedHook):
    """Writes and logs the training speed, `global_step/sec`, every N steps or seconds.

    The clock starts after the session's first run (which compiles the step), and
    rates are written after steps N, 2N, ... for `every_n_steps=N` (100, 200, ... for
    100; a resumed run keeps the schedule), each over the steps since the one before
    (the first over steps 2 to N). With a known batch size
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

    def next_trigger(self, step: int) -> Trigger | None:
        if self._last_step is None:  # no run since the session was created (`after_create_session` resets both)
            return Trigger(step + 1)  # the first run (a step alone) starts the clock
        return self.timer.next_trigger(step)

    def begin(self) -> None:
        show_info_logs()
        self._slot.open()

    def after_create_session(self, session) -> None:
        self._slot.restarted(session)
        self.timer.reset()  # a restored or recovered step starts a new interval, timed from its first run
        self._last_step = None

    def after_run(self, ctx: RunContext, values: RunValues) -> None:
        step, last = values.step, self._last_step
        self._last_step = step
        if last is None:  # the timer was reset with it (`after_create_session`)
            self.timer.start(step)  # after the run that compiled the step
            return
        if step <= last and self._warnings < 5:
            self._warnings += 1
            logger.warning("It seems that the global step has not been increased: it went from %d to %d. "
                           "Rates skip such runs.", last, step)
        if not self.timer.should_trigger_for_step(step):
            return
        rate = self.timer.rate(step)
        if rate is not None:
            report_thread.submit_for(self, self._report, step, rate, ctx.original_args.feeds)

    def _report(self, step: int, rate: float, batch: Any) -> None:
        """The rate's log line and summaries, on the report thread (see `report_thread`)."""
        scalars = {self.tag: rate}
        batch_size = self.batch_size or shared_rows(batch)
        if batch_size:
            scalars["examples/sec"] = rate * batch_size
        logger.info("%s: %g", self.tag, rate)
        if self._slot.writer is not None:
            self._slot.writer.write_scalars(step, scalars)

    def close(self) -> None:
        self._slot.close()

    def __repr__(self) -> str:
        return f"StepCounterHook({self.timer!r})"
