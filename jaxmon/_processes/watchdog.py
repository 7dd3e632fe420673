"""The watchdog: ends a process whose loop made no progress for too long.

A daemon thread looks at the session's step a few times per deadline; it costs the loop
nothing (no call per run). When no step completed for `watchdog_secs` (before the first
step, while the state is created or restored, while the step compiles and while the
session closes: `watchdog_startup_secs`), it writes every thread's stack
(`faulthandler`) and one line saying the last step and what the loop was doing, read
from the loop thread's stack, then ends the process with `WATCHDOG_EXIT_CODE` for a
scheduler to restart it; the restart resumes from the newest complete checkpoint.
With several processes each one watches itself: a peer that hangs in a collective is
caught on every process.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import re
import sys
import tempfile
import threading
import time
from collections.abc import Callable

from jaxmon._base import signals as _signals

logger = logging.getLogger("jaxmon")

#: The exit code of a process the watchdog ended: no step completed within the deadline.
WATCHDOG_EXIT_CODE = 76

#: What the loop is doing, by the jaxmon module its innermost frame is in.
_MODULES = {  # by the path below jaxmon/, without .py
    "_run/batches": "waiting for data (the next batch of the data iterator)",
    "_data/loaders": "waiting for data (the next batch of the data iterator)",
    "_processes/agree": "in an agreement with the other processes (a collective)",
    "_checkpoints/manager": "in a checkpoint save",
    "hooks/_checkpoint": "in a checkpoint save",
    "_checkpoints/orbax_failures": "in a checkpoint save",
    "_run/state_life": "creating or restoring the state",
    "_run/dispatch": "in the step (waiting for the device)",
    "_base/host": "in the step (waiting for the device to return a hook's values)",
    "_metrics/accumulators": "in the step (waiting for the device to return the accumulated metrics)",
    "_run/scan_unroll": "in the step (waiting for the device)",
}
_COMPILING = "compiling the step"


class Watchdog:
    """Watches a session's step from a daemon thread; see the module's docstring.

    Args:
      session: has `step` (the steps completed) and `_closed` (it closes or has closed),
        read from the watchdog's thread.
      secs: the longest time between two completed steps.
      startup_secs: the same before the first step, while the state is created or
        restored, while the step compiles, and while the session closes.
    """

    @classmethod
    def of(cls, watched: Callable[[], tuple[int, bool, int | None]], secs: float | None,
           startup_secs: float) -> Watchdog | _Off:
        """A watchdog (the start-up deadline at least `secs`); without `secs`, one that does nothing."""
        return _Off() if secs is None else cls(watched, secs, max(secs, startup_secs))

    def __init__(self, watched: Callable[[], tuple[int, bool, int | None]], secs: float, startup_secs: float):
        self._watched, self.secs, self.startup_secs = watched, float(secs), float(startup_secs)
        self._loop = threading.get_ident()  # the thread the session runs in
        (self._seen, self._closing, _), self._since, self._started = watched(), time.monotonic(), False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="jaxmon-watchdog", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _watch(self) -> None:
        period = max(0.05, min(self.secs, self.startup_secs) / 10)
        while not self._stop.wait(period):
            (step, closing, restored), now = self._watched(), time.monotonic()
            if step != self._seen or closing != self._closing:  # a step completed (or the state was restored)
                self._started = self._started or (step != self._seen and step != restored)
                self._seen, self._closing, self._since = step, closing, now
                continue
            waited = now - self._since
            if waited < self.secs:
                continue
            stacks = _stacks()
            doing = _doing(stacks, self._loop)
            slow = not self._started or closing or doing in (_COMPILING, _MODULES["_run/state_life"])
            deadline = self.startup_secs if slow else self.secs
            if waited >= deadline and not self._stop.is_set():
                self._fire(step, waited, deadline, doing, stacks)  # never returns

    def doing(self) -> str:
        """What the loop thread is doing now, in words."""
        return _doing(_stacks(), self._loop)

    def _fire(self, step: int, waited: float, deadline: float, doing: str, stacks: str) -> None:
        name = "watchdog_startup_secs" if deadline == self.startup_secs and deadline != self.secs else "watchdog_secs"
        line = (f"{_failure_prefix()}the watchdog ended the run: no step completed in {waited:.1f} s "
                f"({name}={deadline:g}); the last step was {step} and the loop was {doing}. Every thread's "
                f"stack is above. Exit code {WATCHDOG_EXIT_CODE}: run the same command to resume from the "
                "newest complete checkpoint.")
        stderr = sys.__stderr__ or sys.stderr  # the process's own: `jaxmon train` keeps other threads' text out
        try:
            _flush_records()
            _signals.flush_std_streams()
            print(f"{_failure_prefix()}watchdog: the stacks of every thread follow.\n{stacks}{line}", file=stderr,
                  flush=True)
            logging.shutdown()
        finally:
            os._exit(WATCHDOG_EXIT_CODE)


#: Seconds the watchdog gives the summary writers to hand what they hold to the operating
#: system before it ends the process (a writer that hangs too does not hold the exit).
FLUSH_SECS = 5.0


def _flush_records() -> None:
    """The summaries written so far (every step the hooks were given), on disk before the
    process ends: a flush of every writer, within `FLUSH_SECS`."""
    from jaxmon._writers.slot import flush_all

    def flush() -> None:
        try:
            flush_all()
        except Exception as error:  # noqa: BLE001 - ending the process matters more; say why it could not
            logging.getLogger("jaxmon").warning("The watchdog could not flush the summaries: %r", error)

    thread = threading.Thread(target=flush, name="jaxmon-watchdog-flush", daemon=True)
    thread.start()
    thread.join(FLUSH_SECS)


class _Off:
    """No watchdog."""

    def stop(self) -> None:
        pass


def _stacks() -> str:
    """Every thread's stack, as `faulthandler` writes it (innermost frame first)."""
    with tempfile.TemporaryFile("w+") as file:
        faulthandler.dump_traceback(file=file, all_threads=True)
        file.seek(0)
        return file.read()


_THREAD = re.compile(r"^(?:Current thread|Thread) (0x[0-9a-f]+) ", re.MULTILINE)
_FRAME = re.compile(r'^  File "(.*)", line (\d+) in (\S+)$', re.MULTILINE)
_EVENTS = frozenset(("begin", "after_create_session", "before_run", "after_run", "after_read", "end", "close",
                     "next_trigger", "get_state", "set_state"))


def _doing(stacks: str, thread: int) -> str:
    """What `thread` is doing, in words, from its innermost recognised frame in `stacks`."""
    starts = [(int(match.group(1), 16), match.end()) for match in _THREAD.finditer(stacks)]
    for i, (ident, start) in enumerate(starts):
        if ident == thread:
            stack = stacks[start:starts[i + 1][1] if i + 1 < len(starts) else len(stacks)]
            break
    else:
        return "nowhere: its thread has ended"
    package, frames = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep, _FRAME.findall(stack)
    runner = os.path.join(package, "_run", "hook_runner.py")
    restoring = any(path == os.path.join(package, "_run", "state_life.py") for path, _, _ in frames)
    for depth, (path, line, function) in enumerate(frames):
        if path.endswith(os.path.join("jax", "_src", "compiler.py")):
            return _COMPILING
        if path.startswith(package):
            module = os.path.splitext(path[len(package):])[0].replace(os.sep, "/")
            what = _MODULES.get(module)
            if module in ("_checkpoints/manager", "_checkpoints/orbax_failures") and restoring:
                return _MODULES["_run/state_life"]  # reading the checkpoint it restores
            if what is not None:
                return what
        if function in _EVENTS and depth + 1 < len(frames) and frames[depth + 1][0] == runner:
            return f"in a hook: {function} ({os.path.basename(path)}, line {line})"  # a hook's event
    return "outside the session (in the code between two runs)"


def _failure_prefix() -> str:
    from jaxmon._processes import agree as _agree
    return _agree.failure_line["prefix"] + _agree.failure_line["where"]
