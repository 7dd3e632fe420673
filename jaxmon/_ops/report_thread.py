"""The report thread: what a trigger does that need not hold up the training loop.

Summary writes, the hooks' log lines and the late `after_run`s of the hooks that only
report (`reports` marks them) run in order on one daemon thread, `jaxmon-report`: the loop
only lists them (`submit`), and hands the list over after a run's events (`flush`: one
wake-up of the thread per trigger, not one per write; the hook runner hands a trigger
run's reports over with its late calls, after the next run's step). What is queued
is bounded (a loop that reports faster than the thread keeps up waits, rather than
growing memory). `wait()` returns once everything submitted before it is done: a
session's `sync()`, every checkpoint (through `flush_all`) and `close()` call it, so that
a checkpoint's steps are reported on disk when it is complete.

A failure of work queued here goes to the box of the session that queued it
(`failures.current()` when it was submitted), which raises it on the loop after its next
run's step, or by `sync()`; the hook runner (and `submit_for`, for a hook's own reports)
applies the hook's `on_error` first.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from collections.abc import Callable
from typing import Any

from jaxmon._ops import failures

logger = logging.getLogger("jaxmon")

#: The most pieces of work submitted before `submit` hands them over, and the most lists of
#: them (a run's reports each) queued before `flush` waits for the thread.
MAX_QUEUED = 1000

class ReportThread:
    """One `jaxmon-report` thread and what waits for it: the work submitted since the last
    hand-over (`pending`), the lists handed over (`queue`), under one lock."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()  # lists of (fn, args, box); a put wakes the thread
        self._pending: list[tuple[Callable[..., Any], tuple, Any]] = []  # submitted since the last `flush`
        self._thread: threading.Thread | None = None
        self._ident: int | None = None  # the thread's
        self._lock = threading.Lock()

    def submit(self, fn: Callable[..., Any], *args: Any) -> None:
        """Calls `fn(*args)` on the report thread after everything submitted before it, once
        handed over (`flush`, `wait`); on that thread itself: now, which keeps the order."""
        if threading.get_ident() == self._ident:
            fn(*args)
            return
        with self._lock:
            self._pending.append((fn, args, failures.current()))
            full = len(self._pending) >= MAX_QUEUED
        if full:
            self.flush()

    def flush(self) -> None:
        """Hands what was submitted since the last `flush` to the report thread (one wake-up);
        waits first while the thread is `MAX_QUEUED` behind."""
        if not self._pending:  # most runs submit nothing; a submit this misses was not before this flush
            return
        with self._lock:
            work, self._pending = self._pending, []
            if work and self._thread is None:
                self._thread = threading.Thread(target=self._work, name="jaxmon-report", daemon=True)
                self._thread.start()
        if not work:
            return
        if self._queue.qsize() >= MAX_QUEUED:  # the thread is far behind: let it catch up rather than grow
            self.wait()
        self._queue.put(work)

    def wait(self) -> None:
        """Returns once everything submitted so far is done (on the report thread: at once)."""
        if threading.get_ident() == self._ident:
            return
        self.flush()
        if self._thread is not None:
            done = threading.Event()
            self._queue.put([(done.set, (), None)])
            done.wait()

    def _work(self) -> None:
        self._ident = threading.get_ident()
        while True:
            for fn, args, box in self._queue.get():
                try:
                    if box is None:
                        fn(*args)
                    else:
                        with box:  # what fails inside it (a writer's write) goes there too
                            fn(*args)
                except BaseException as error:  # noqa: BLE001 - raised on the loop; the thread goes on
                    failures.report(box, error, "A report")


#: The process's report thread (a forked child makes its own: the thread is not forked).
_thread = ReportThread()


def submit(fn: Callable[..., Any], *args: Any) -> None:
    """`ReportThread.submit` on the process's report thread."""
    _thread.submit(fn, *args)


def submit_for(hook: Any, fn: Callable[..., Any], *args: Any) -> None:
    """`submit(fn, *args)`, a report of `hook`'s, under its `on_error`: a failure is raised
    on the loop after a later run's step ("raise") or logged ("warn")."""
    submit(_under_policy, hook, fn, args)


def _under_policy(hook: Any, fn: Callable[..., Any], args: tuple) -> None:
    try:
        fn(*args)
    except Exception as error:
        if hook.on_error != "warn":
            raise  # into the session's failures: raised on the loop
        logger.warning("%r failed to report on the report thread (on_error='warn'): %r", hook, error)


def flush() -> None:
    """`ReportThread.flush` on the process's report thread."""
    _thread.flush()


def wait() -> None:
    """`ReportThread.wait` on the process's report thread."""
    _thread.wait()


def reports(after_run: Callable[..., None]) -> Callable[..., None]:
    """Marks a hook class's `after_run` as one that only reports what it is given (log
    lines, summaries): called with late values (`RunArgs(late=True)`), the session calls
    it on the report thread. A subclass that overrides `after_run` is called on the loop."""
    after_run.reports_off_loop = True
    return after_run


def reports_off_loop(hook: Any) -> bool:
    """Whether `hook`'s late `after_run` runs on the report thread (see `reports`)."""
    return getattr(type(hook).after_run, "reports_off_loop", False)


def _forget_thread() -> None:
    """In a forked child the thread is gone: a new one starts at the next `flush`."""
    global _thread
    _thread = ReportThread()


os.register_at_fork(after_in_child=_forget_thread)
