"""A session's failures found off its loop: a save that failed in the background, a
report or a summary write that failed on the report thread.

Each session owns one `Failures` box and asks it once per run, after the run's step
(`bool(box)` is one look at a deque; with several processes every process then fails
at the same step). Work that may fail later, on another thread, is told which box to
report to when it is handed over: the box of the session whose method is running on
the handing thread (`current()`; the session enters its box in `run`, `sync`, `close`
and its creation). What fails with no session's method running is logged, and its
owner (a writer, a checkpoint directory) still raises it at its next call.
"""

from __future__ import annotations

import collections
import contextvars
import logging
import threading
from collections.abc import Callable

logger = logging.getLogger("jaxmon")

#: The box of the session running on this thread (the report thread: of the work it runs).
_CURRENT: contextvars.ContextVar[Failures | None] = contextvars.ContextVar("jaxmon_failures", default=None)


class Failures:
    """The failures a session finds off its loop, until it raises them.

    Each is a function of the step training stopped at that raises the failure, or does
    nothing where its owner raised it already (a writer raises its failure at its next
    call too; whichever comes first raises it, once).

    Example:
      >>> box = Failures()
      >>> bool(box)
      False
      >>> box.add_error(OSError("disk full"))
      >>> try:
      ...     box.raise_first(7)
      ... except OSError as error:
      ...     print(error)
      disk full
      >>> bool(box)
      False
    """

    def __init__(self):
        self._found: collections.deque[Callable[[int], None]] = collections.deque()  # appends are thread-safe
        self._entered = threading.local()  # each thread's tokens of the `with` blocks it is in

    def __bool__(self) -> bool:
        return bool(self._found)

    def add(self, raise_it: Callable[[int], None]) -> None:
        """Keeps `raise_it(step)`, which raises a failure found off the loop (any thread)."""
        self._found.append(raise_it)

    def add_error(self, error: BaseException) -> None:
        """Keeps `error`, to be raised as it is."""
        def raise_it(step: int) -> None:
            raise error

        self.add(raise_it)

    def raise_first(self, step: int) -> None:
        """Raises the first failure still unraised (training stopped after `step`); the
        rest wait for the next ask."""
        while self._found:
            self._found.popleft()(step)

    def __enter__(self) -> Failures:
        """Makes this the box of the calling thread (`current()`) until the `with` ends."""
        self._entered.__dict__.setdefault("tokens", []).append(_CURRENT.set(self))
        return self

    def __exit__(self, *exc: object) -> None:
        _CURRENT.reset(self._entered.tokens.pop())


def current() -> Failures | None:
    """The box of the session running on this thread (None: none)."""
    return _CURRENT.get()


def report(box: Failures | None, error: BaseException, what: str) -> None:
    """`error` of work off the loop, into `box`; logged where no session was open."""
    if box is not None:
        box.add_error(error)
    else:
        logger.warning("%s failed with no session running to raise it: %r", what, error, exc_info=error)
