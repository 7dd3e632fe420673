"""Orbax's log: tens of INFO lines a checkpoint through absl's logger (its handlers, its
threads, each save's steps), which a program's `logging.basicConfig(level=logging.INFO)`
would print. The first checkpoint manager of a process keeps them out (`quiet_orbax`)."""

from __future__ import annotations

import logging
import os


class _OrbaxInfo(logging.Filter):
    """Drops Orbax's INFO and DEBUG records (tens a checkpoint: its handlers, its
    threads, each save's steps), which reach a program's `logging.basicConfig(level=
    logging.INFO)` through absl's logger, unless that logger itself is set to let them
    through (`logging.getLogger("absl").setLevel(logging.INFO)`). Warnings and errors pass."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.WARNING or f"{os.sep}orbax{os.sep}" not in record.pathname:
            return True
        own = logging.getLogger("absl").level
        return own != logging.NOTSET and own <= record.levelno


#: The filter `quiet_orbax` puts on absl's logger.
ORBAX_INFO = _OrbaxInfo()


def quiet_orbax() -> None:
    """Puts `ORBAX_INFO` on absl's logger (once: a filter is added once however often)."""
    logging.getLogger("absl").addFilter(ORBAX_INFO)
