"""Stragglers: with several JAX processes, the one whose host work holds the others up.

Each agreement carries every process's host time per step since the last one: the wall
time between the end of one agreement's all-gather and the start of the next, so that
waiting for the others (inside the all-gather) is not counted, divided by the steps in
between. A process above `factor` times the median of all of them (and slower by more
than `min_secs` per step) at `patience` agreements in a row is a straggler: every
process logs it, naming it, at most once per `window_steps` steps, and the chief writes
`stragglers/*` summaries into its summary directory.
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections.abc import Sequence

logger = logging.getLogger("jaxmon")


class Stragglers:
    """The host time per step of every process, from one agreement to the next.

    Args:
      factor: how many times the median host time per step makes a process slow.
      patience: how many agreements in a row a process must be slow to be reported.
      min_secs: the least excess over the median, per step, that counts (noise below).
      window_steps: the fewest steps between two reports of one process.
    """

    def __init__(self, factor: float = 1.5, patience: int = 3, min_secs: float = 0.002, window_steps: int = 1000):
        self.factor, self.patience, self.min_secs, self.window_steps = factor, patience, min_secs, window_steps
        self._since: tuple[float, int] | None = None  # (time, step) at the end of the last all-gather
        #: Every process's host seconds per step at the last agreement (empty: not known yet).
        self.host_per_step: tuple[float, ...] = ()
        self._slow: dict[int, int] = {}
        self._told: dict[int, int] = {}  # process -> the step it was last reported at

    def measure(self, step: int) -> float:
        """This process's host seconds per step since the last agreement (NaN: unknown)."""
        if self._since is None or step <= self._since[1]:
            return math.nan
        return (time.monotonic() - self._since[0]) / (step - self._since[1])

    def agreed(self, step: int, hosts: Sequence[float], summary_dir: str | None = None) -> None:
        """Every process's `hosts` time per step at the agreement after `step`; reports a straggler."""
        self._since = (time.monotonic(), step)
        if not hosts or any(math.isnan(host) for host in hosts):
            return
        self.host_per_step = tuple(hosts)
        median = statistics.median(hosts)
        for process, host in enumerate(hosts):
            slow = host > self.factor * median and host - median > self.min_secs
            count = self._slow[process] = self._slow.get(process, 0) + 1 if slow else 0
            told = self._told.get(process)
            if count >= self.patience and (told is None or step - told >= self.window_steps):
                self._told[process] = step
                self._report(step, process, host, median, summary_dir)

    def _report(self, step: int, process: int, host: float, median: float, summary_dir: str | None) -> None:
        logger.warning("Process %d is a straggler: %.1f ms of host time per step, %.1fx the median of the %d "
                       "processes (%.1f ms), at the last %d agreements up to step %d; the others wait for it.",
                       process, host * 1e3, host / median, len(self.host_per_step), median * 1e3,
                       self._slow[process], step)
        if summary_dir is not None:
            from jaxmon._writers import SummaryWriterCache

            writer = SummaryWriterCache.get(summary_dir)
            try:
                writer.write_scalars(step, {"stragglers/slowest_process": float(process),
                                            "stragglers/slowest_ratio": host / median,
                                            **{f"stragglers/process_{i}_ms_per_step": h * 1e3
                                               for i, h in enumerate(self.host_per_step)}})
            finally:
                writer.close()
