"""GoodputHook: where a run's wall time went, over its whole life, restarts included."""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable, Mapping
from typing import Any

from jaxmon._base.errors import check_number, check_on_error
from jaxmon._base.hook import RunContext, RunValues
from jaxmon._base.timed import TimedHook
from jaxmon._base.triggers import Trigger, timer_for
from jaxmon._ops import report_thread
from jaxmon._ops.time_spent import CATEGORIES, FILE, breakdown, read_record, write_record
from jaxmon._writers.slot import WriterSlot

logger = logging.getLogger("jaxmon")

#: The categories a redone step's time was spent in, and is taken from when it is lost.
_STEP_TIME = ("productive", "data", "hooks")


class GoodputHook(TimedHook):
    """Where the run's wall time went, every second in one category, over the run's whole
    life: every process that trained it, restarts included (local; no cloud service).

    Categories (seconds): `productive` (dispatching steps and waiting for the device),
    `compile` (the step's compilations), `init` (building a fresh state), `restore`
    (restoring one from a checkpoint),
    `checkpoint` (the saver's blocking time: snapshot, host copy, the last save's wait),
    `data` (waiting for the data iterator), `evaluation` (`EvalHook`s), `hooks` (every
    other hook's host time), `lost` (the time of steps a restart or roll-back redid: a
    resumed run knows how far the process before got) and `idle` (between two processes
    of the run). Written as `goodput/<category>` and `goodput/goodput` (productive over
    all) summaries every `every_n_steps` steps or `every_n_secs` seconds and at close
    (not at a preemption's stop: a resumed run keeps the records a whole run has),
    and into `output_dir/goodput.json`, which the next process of the run reads;
    `jaxmon inspect RUN` prints it. The checkpoint keeps the totals too.

    Args:
      output_dir: the run's directory (its summaries and `goodput.json`); or
        summary_writer: a writer (then no `goodput.json`: restarts start from the
        checkpoint's totals, with no lost or idle time).
      every_n_steps, every_n_secs: how often the breakdown is written as summaries.
      record_every_secs: the least time between two writes of `goodput.json` (and at
        close): a process killed later counts the steps after its last record as idle.

    Example:
      >>> import jaxmon as jm
      >>> hook = jm.GoodputHook(output_dir="runs/example", every_n_steps=100)
    """

    def __init__(self, output_dir: str | os.PathLike | None = None, summary_writer: Any = None, *,
                 every_n_steps: int | None = 100, every_n_secs: float | None = None, record_every_secs: float = 10.0,
                 on_error: str = "warn", clock: Callable[[], float] = time.monotonic):
        self.timer = timer_for("GoodputHook", clock, every_n_steps=every_n_steps, every_n_secs=every_n_secs)
        self._slot = WriterSlot("GoodputHook", output_dir, summary_writer, required=True)
        self._path = None if output_dir is None else os.path.join(os.fspath(output_dir), FILE)
        check_number("GoodputHook record_every_secs", record_every_secs)
        self.record_every_secs, self._recorded = record_every_secs, -math.inf  # goodput.json: when last written
        self.on_error = check_on_error("GoodputHook", on_error)
        self._session: Any = None
        self._before = dict.fromkeys(CATEGORIES, 0.0)  # the run's earlier processes
        self._checkpointed: dict[str, float] | None = None  # the totals a restored checkpoint holds
        self._start_step = self._last_step = 0
        self._redone_steps, self._lost = 0, 0.0  # steps this session ran twice (recoveries, roll-backs)
        self._written: int | None = None  # the step of the last summaries
        self._processes = 1  # how many processes (one after the other) the run has had, this one included

    def begin(self) -> None:
        self._session, self._lost = None, 0.0
        self._slot.open()

    def after_create_session(self, session) -> None:
        self._slot.restarted(session)
        if self._session is None:  # this process's first state: the earlier processes' time
            self._session, self._redone_steps = session, session.time_spent.redone_steps
            self._start_step, self._written = session.step, session.restored_step  # its records are on disk
            self._before = self._earlier(session.restored_step, session.time_spent.start)
        redone = session.time_spent.redone_steps - self._redone_steps
        if redone > 0:  # a recovery or roll-back: the steps after the restored one are run again
            self._lost += redone * self._secs_per_step(session.step + redone)
            self._redone_steps += redone
        self._last_step = session.step
        self.timer.start(session.step)

    def next_trigger(self, step: int) -> Trigger | None:
        return self.timer.next_trigger(step)

    def after_run(self, ctx: RunContext, values: RunValues) -> None:
        self._last_step = values.step
        if self.timer.due(values.step):
            self._write(values.step)

    def close(self) -> None:  # after every hook's `end` (the last save's wait included), also after an error
        try:
            if self._session is not None and self._slot.writer is not None:
                self._last_step = self._session.step
                report_thread.wait()  # the earlier reports first
                summarized, clocks, record = self._figures(self._session.step, last=True)
                if self._session.preemption_requested:  # no end of the run: its summaries at their steps only
                    summarized = None
                self._report(summarized, clocks, record)  # on disk before the process may end
        except Exception as error:
            logger.warning("GoodputHook: writing the last breakdown failed: %r", error)
        finally:
            self._slot.close()

    def get_state(self) -> dict[str, Any]:
        return {**super().get_state(), "goodput": self.totals()}

    def set_state(self, state: dict[str, Any]) -> None:
        super().set_state(state)
        self._checkpointed = state.get("goodput")

    def spent(self) -> dict[str, float]:
        """This process's seconds by category (its redone steps' time as lost)."""
        if self._session is None:
            return dict.fromkeys(CATEGORIES, 0.0)
        spent = self._session.time_spent
        return _spent(spent.elapsed(), spent.secs, self._lost)

    def totals(self) -> dict[str, float]:
        """The run's seconds by category, over every process of it so far (before a
        session: what `set_state` gave)."""
        if self._session is None and self._checkpointed is not None:
            return dict(self._checkpointed)
        spent = self.spent()
        return {category: self._before[category] + spent[category] for category in CATEGORIES}

    def _secs_per_step(self, reached: int) -> float:
        """The mean time of a step this session ran, up to step `reached`."""
        steps = reached - self._start_step + self._redone_steps
        spent = self.spent()
        return sum(spent[k] for k in _STEP_TIME) / steps if steps > 0 else 0.0

    def _write(self, step: int) -> None:
        """The breakdown of `step` written on the report thread (see `report_thread`): the loop
        only takes the figures."""
        summarized, clocks, record = self._figures(step)
        report_thread.submit_for(self, self._report, summarized, clocks, record)
        if record is not None:  # what a killed process leaves to the next one: handed over now
            report_thread.flush()

    def _figures(self, step: int, last: bool = False) -> tuple[int | None, tuple, dict[str, Any] | None]:
        """What `_report` writes after `step`: the step of its summaries (None: written
        already; a step's record is never written twice), this process's clocks (see
        `_spent`), and the record for `goodput.json` (at most every `record_every_secs`,
        and the `last` time)."""
        summarized = None if step == self._written else step
        spent = self._session.time_spent
        self._written, clocks, record = step, (spent.elapsed(), dict(spent.secs), self._lost), None
        now = time.monotonic()
        if self._path is not None and (last or now - self._recorded >= self.record_every_secs):
            self._recorded = now
            record = {"processes": self._processes, "before": dict(self._before), "process": {
                "start": spent.start, "updated": time.time(), "first_step": self._start_step,
                "last_step": self._last_step, "steps_run": self._last_step - self._start_step + self._redone_steps,
                "spent": _spent(*clocks)}}
        return summarized, clocks, record

    def _report(self, step: int | None, clocks: tuple, record: dict[str, Any] | None) -> None:
        """The breakdown as `goodput/*` summaries of `step` (None: none) and `record` into `goodput.json`."""
        if step is not None:
            spent = _spent(*clocks)
            totals = {category: self._before[category] + spent[category] for category in CATEGORIES}
            wall = sum(totals.values())
            scalars = {f"goodput/{category}": secs for category, secs in totals.items()}
            scalars["goodput/goodput"] = totals["productive"] / wall if wall > 0 else 0.0
            self._slot.writer.write_scalars(step, scalars)
        if record is not None:
            write_record(self._path, record)

    def _earlier(self, restored: int | None, start: float) -> dict[str, float]:
        """The seconds of the run's processes before this one, by category: the last one's
        steps after `restored` (the step this one resumed from) are lost, and the time
        between its last record and this process's `start` is idle."""
        record = None
        try:
            record = read_record(self._path) if self._path is not None else None
        except (OSError, ValueError) as error:
            logger.warning("GoodputHook: %s is unreadable (%s); the run's earlier time is not counted.",
                           self._path, error)
        if record is None:  # no file: the checkpoint's totals, if resumed from one
            return {**dict.fromkeys(CATEGORIES, 0.0), **(self._checkpointed or {})} if restored is not None else \
                dict.fromkeys(CATEGORIES, 0.0)
        self._processes = int(record.get("processes", 0)) + 1
        before = {**dict.fromkeys(CATEGORIES, 0.0), **record.get("before", {})}
        last = record.get("process") or {}
        spent = {**dict.fromkeys(CATEGORIES, 0.0), **last.get("spent", {})}
        redone = last.get("last_step", 0) - (restored if restored is not None else last.get("first_step", 0))
        steps = last.get("steps_run", 0)
        if redone > 0 and steps > 0:
            spent = _moved_to_lost(spent, sum(spent[k] for k in _STEP_TIME) * min(redone, steps) / steps)
        spent["idle"] += max(0.0, start - last.get("updated", start))
        return {category: before[category] + spent[category] for category in CATEGORIES}

    def __repr__(self) -> str:
        return f"GoodputHook({self.timer!r})"


def _spent(elapsed: float, secs: Mapping[str, float], lost: float) -> dict[str, float]:
    """Seconds by category from a session's clocks (`TimeSpent`), `lost` of them taken from the steps."""
    return _moved_to_lost(breakdown(elapsed, secs), lost)


def _moved_to_lost(spent: Mapping[str, float], lost: float) -> dict[str, float]:
    """`spent` with `lost` seconds taken from the step categories, in proportion, into `lost`."""
    spent = dict(spent)
    pool = sum(spent[k] for k in _STEP_TIME)
    lost = min(lost, pool)
    if lost > 0:
        for k in _STEP_TIME:
            spent[k] -= lost * spent[k] / pool
        spent["lost"] += lost
    return spent
