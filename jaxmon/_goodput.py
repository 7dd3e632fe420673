"""Where a session's wall time goes: the clocks its parts add to (`TimeSpent`).

Each part times its own work on the loop's thread and adds it to one category: the data
iterator (`data`), the first call of each compiled step (`compile`), building or
restoring the state (`restore`), the hooks' events (`checkpoint` for a checkpoint
saver's, `evaluation` for an `EvalHook`'s, `hooks` for the rest). The rest of the
session's life is productive: dispatching steps and waiting for the device. A quiet run
costs one clock pair, for its batch. `jm.GoodputHook` turns them into the run's
breakdown, with the steps a restart redid (`lost`) and the time between two processes
of the run (`idle`).
"""

from __future__ import annotations

import time
from typing import Any

#: The categories a run's wall time is split into, in the order they are reported.
CATEGORIES = ("productive", "compile", "restore", "checkpoint", "data", "evaluation", "hooks", "lost", "idle")


class TimeSpent:
    """Seconds of the loop's thread by category, since the session was made."""

    def __init__(self) -> None:
        self.start, self.started = time.time(), time.perf_counter()
        self.secs = dict.fromkeys(("compile", "restore", "checkpoint", "data", "evaluation", "hooks"), 0.0)
        #: How many steps a recovery or roll-back made this session run again.
        self.redone_steps = 0

    def went_back(self, step: int, to: int) -> None:
        """The state at `step` was replaced by one of step `to` (a restore)."""
        self.redone_steps += max(0, step - to)

    def add(self, category: str, secs: float) -> None:
        self.secs[category] += secs

    def elapsed(self) -> float:
        """Wall seconds since the session was made."""
        return time.perf_counter() - self.started

    def breakdown(self) -> dict[str, float]:
        """Every second since the session was made, in `CATEGORIES` (`lost` and `idle`
        are 0 here: only a resumed run knows them)."""
        productive = max(0.0, self.elapsed() - sum(self.secs.values()))
        return {"productive": productive, **self.secs, "lost": 0.0, "idle": 0.0}


def category_of(hook: Any) -> str:
    """The category of `hook`'s time: its class's `time_category` ("checkpoint" for a
    checkpoint saver, "evaluation" for an `EvalHook`), else "hooks"."""
    category = getattr(type(hook), "time_category", "hooks")
    return category if category in ("checkpoint", "evaluation") else "hooks"
