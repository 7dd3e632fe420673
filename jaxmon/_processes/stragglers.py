"""Stragglers: with several JAX processes, the one whose host work holds the others up.

Each agreement carries every process's host time per step since the last one: the wall
time between the end of one agreement's all-gather and the start of the next, so that
waiting for the others (inside the all-gather) is not counted, less the time its hooks'
events took (the chief runs hooks the others do not: summaries, logs), divided by the
steps in between. A process above `factor` times the median of the others (and slower by
more than `min_secs` per step) at `patience` agreements in a row is a straggler: every
process logs it, naming it, at most once per `window_steps` steps, and the chief writes
`stragglers/*` summaries into its summary directory.
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections.abc import Sequence

import jax

logger = logging.getLogger("jaxmon")


class Stragglers:
    """The host time per step of every process, from one agreement to the next.

    Args:
      factor: how many times the others' median host time per step makes a process slow.
      patience: how many agreements in a row a process must be slow to be reported.
      min_secs: the least excess over the others' median, per step, that counts (noise below).
      window_steps: the fewest steps between two reports of one process.
    """

    def __init__(self, factor: float = 1.5, patience: int = 3, min_secs: float = 0.002, window_steps: int = 1000):
        self.factor, self.patience, self.min_secs, self.window_steps = factor, patience, min_secs, window_steps
        # (time, step, the hooks' seconds so far) at the end of the last all-gather
        self._since: tuple[float, int, float] | None = None
        #: Every process's host seconds per step at the last agreement (empty: not known yet).
        self.host_per_step: tuple[float, ...] = ()
        self._slow: dict[int, int] = {}
        self._told: dict[int, int] = {}  # process -> the step it was last reported at

    def measure(self, step: int, hook_secs: float = 0.0) -> float:
        """This process's host seconds per step since the last agreement, less its hooks'
        (`hook_secs`: their seconds so far, a running total) (NaN: unknown)."""
        if self._since is None or step <= self._since[1]:
            return math.nan
        since, since_step, since_hooks = self._since
        return (time.monotonic() - since - (hook_secs - since_hooks)) / (step - since_step)

    def agreed(self, step: int, hosts: Sequence[float], summary_dir: str | None = None,
               hook_secs: float = 0.0) -> None:
        """Every process's `hosts` time per step at the agreement after `step` (`hook_secs`:
        as `measure` had it); reports a straggler."""
        self._since = (time.monotonic(), step, hook_secs)
        if len(hosts) < 2 or any(math.isnan(host) for host in hosts):
            return
        self.host_per_step = tuple(hosts)
        for process, host in enumerate(self.host_per_step):
            others = statistics.median(self.host_per_step[:process] + self.host_per_step[process + 1:])
            slow = host > self.factor * others and host - others > self.min_secs
            count = self._slow[process] = self._slow.get(process, 0) + 1 if slow else 0
            told = self._told.get(process)
            if count >= self.patience and (told is None or step - told >= self.window_steps):
                self._told[process] = step
                self._report(step, process, host, others, summary_dir)

    def _report(self, step: int, process: int, host: float, others: float, summary_dir: str | None) -> None:
        count = len(self.host_per_step) - 1
        level = logging.WARNING if jax.process_index() == 0 else logging.INFO  # one line across the processes
        logger.log(level, "Process %d is a straggler: %.1f ms of host time per step, %.1fx the median of the other %s "
                       "(%.1f ms), at the last %d agreements up to step %d; the others wait for it.",
                       process, host * 1e3, host / others, "process" if count == 1 else f"{count} processes",
                       others * 1e3, self._slow[process], step)
        if summary_dir is not None:
            from jaxmon._writers import SummaryWriterCache

            writer = SummaryWriterCache.get(summary_dir)
            try:
                writer.write_scalars(step, {"stragglers/slowest_process": float(process),
                                            "stragglers/slowest_ratio": host / others,
                                            **{f"stragglers/process_{i}_ms_per_step": h * 1e3
                                               for i, h in enumerate(self.host_per_step)}})
            finally:
                writer.close()
