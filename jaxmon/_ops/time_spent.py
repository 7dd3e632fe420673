"""Where a session's wall time goes: the clocks its parts add to (`TimeSpent`).

Each part times its own work on the loop's thread and adds it to one category: the data
iterator (`data`), the first call of each compiled step (`compile`; for a program
compiled in the background, its first call waits for the rest of its compile and traces
it again), building a fresh state (`init`) or restoring one (`restore`), the hooks' events (`checkpoint`
for a checkpoint saver's, `evaluation` for an `EvalHook`'s, `hooks` for the rest). The
rest of the session's life is productive: dispatching steps and waiting for the device.
A quiet run costs one clock pair, for its batch. `jm.GoodputHook` turns them into the
run's breakdown, with the steps a restart redid (`lost`) and the time between two
processes of the run (`idle`).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping
from typing import Any

#: The categories a run's wall time is split into, in the order they are reported.
CATEGORIES = ("productive", "compile", "init", "restore", "checkpoint", "data", "evaluation", "hooks", "lost",
              "idle")


class TimeSpent:
    """Seconds of the loop's thread by category, since the session was made."""

    def __init__(self) -> None:
        self.start, self.started = time.time(), time.perf_counter()
        self.secs = dict.fromkeys(("compile", "init", "restore", "checkpoint", "data", "evaluation", "hooks"), 0.0)
        self._timings = {category: Timing(self.secs, category) for category in self.secs}  # made once: runs time "data"
        #: How many steps a recovery or roll-back made this session run again.
        self.redone_steps = 0

    def went_back(self, step: int, to: int) -> None:
        """The state at `step` was replaced by one of step `to` (a restore)."""
        self.redone_steps += max(0, step - to)

    def timing(self, category: str) -> Timing:
        """A `with` block whose wall seconds go to `category` (`with spent.timing("data"):`;
        one block of a category at a time: no part nests a category in itself)."""
        return self._timings[category]

    def elapsed(self) -> float:
        """Wall seconds since the session was made."""
        return time.perf_counter() - self.started

    def breakdown(self) -> dict[str, float]:
        """Every second since the session was made, in `CATEGORIES` (`lost` and `idle`
        are 0 here: only a resumed run knows them)."""
        return breakdown(self.elapsed(), self.secs)


class Timing:
    """A `with` block timed into one category of a session's seconds (`category`, which
    the block may change for itself); `secs`, once it ended, is the block's own."""

    __slots__ = ("_into", "_default", "category", "_started", "secs")

    def __init__(self, into: dict[str, float], category: str):
        self._into, self._default, self.category, self._started, self.secs = into, category, category, 0.0, 0.0

    def __enter__(self) -> Timing:
        self.category, self._started = self._default, time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.secs = time.perf_counter() - self._started
        self._into[self.category] += self.secs


def breakdown(elapsed: float, secs: Mapping[str, float]) -> dict[str, float]:
    """`elapsed` wall seconds in `CATEGORIES`: `secs` by category, the rest productive."""
    return {"productive": max(0.0, elapsed - sum(secs.values())), **secs, "lost": 0.0, "idle": 0.0}


#: The file in a run's summary directory that carries its breakdown from one process of
#: the run to the next (`jm.GoodputHook` writes it, `jaxmon inspect` reads it).
FILE = "goodput.json"


def read_record(path: str) -> dict[str, Any] | None:
    """The record in `goodput.json` at `path`; None when there is none.

    Raises:
      OSError, ValueError: the file cannot be read, or holds no JSON object.
    """
    try:
        with open(path, encoding="utf-8") as file:
            record = json.load(file)
    except FileNotFoundError:
        return None
    if not isinstance(record, dict):
        raise ValueError(f"{path} holds no JSON object")
    return record


def write_record(path: str, record: dict[str, Any]) -> None:
    """Writes `record` to `path` through a file of its own, so that a reader never sees half of it."""
    temporary = f"{path}.{os.getpid()}.tmp"
    with open(temporary, "w", encoding="utf-8") as file:
        json.dump(record, file)
    os.replace(temporary, path)


def recorded_seconds(record: dict[str, Any]) -> dict[str, float]:
    """The run's seconds by category in a `goodput.json` record: its earlier processes'
    and its last one's, as that one last wrote them."""
    before, spent = record["before"], record["process"]["spent"]
    return {category: float(before.get(category, 0.0)) + float(spent.get(category, 0.0))
            for category in {**before, **spent}}


def process_seconds() -> float | None:
    """Wall seconds since this process started (None where the OS does not say: Linux's
    /proc does)."""
    try:
        with open("/proc/self/stat") as stat:
            started = int(stat.read().rpartition(")")[2].split()[19]) / os.sysconf("SC_CLK_TCK")
        with open("/proc/uptime") as uptime:
            return float(uptime.read().split()[0]) - started
    except (OSError, ValueError, IndexError):
        return None


def start_up(before: Mapping[str, float], created: Mapping[str, float], session_secs: float,
             secs: Mapping[str, float], total: float) -> dict[str, float]:
    """Where the seconds to a run's first step went, every one of `total` counted once.

    Args:
      before: the seconds before the session, by part (imports and config, data and model).
      created: the session's seconds by category once it was created (`TimeSpent.secs`).
      session_secs: the seconds the session's creation took (its state and checkpoint 0
        among them).
      secs: the session's seconds by category at its first step.
      total: the seconds from the process's start to the first step.
    """
    def first_run(*categories: str) -> float:
        return sum(secs[category] - created[category] for category in categories)

    state = created["init"] + created["restore"]
    parts = {**before, "state": state, "checkpoint 0": created["checkpoint"],
             "session set-up": max(0.0, session_secs - state - created["checkpoint"]),
             "compile": first_run("compile"), "first evaluation": first_run("evaluation"),
             "first batch and hooks": first_run("data", "hooks", "checkpoint", "init", "restore")}
    parts["the rest"] = max(0.0, total - sum(parts.values()))
    return parts


def category_of(hook: Any) -> str:
    """The category of `hook`'s time: its class's `time_category` ("checkpoint" for a
    checkpoint saver, "evaluation" for an `EvalHook`), else "hooks"."""
    category = getattr(type(hook), "time_category", "hooks")
    return category if category in ("checkpoint", "evaluation") else "hooks"
