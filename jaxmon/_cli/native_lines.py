"""Lines native libraries print on the process's standard output that a run does not
need: Gloo's `[Gloo] Rank 0 is connected to 1 peer ranks...` once per process and
communicator (a C++ `std::cout` no flag turns off). `jaxmon train` drops them unless
`--debug`; Python's own output goes on to the terminal as it was."""

from __future__ import annotations

import atexit
import fcntl
import os
import struct
import sys
import termios
import threading
import time

#: The starts of the native lines dropped.
DROPPED = (b"[Gloo] ",)
#: The longest the exit waits for the pipe's lines to be copied.
DRAIN_SECS = 2.0


def drop_native_lines() -> None:
    """Sends file descriptor 1 through a thread that drops the `DROPPED` lines, and gives
    Python's `sys.stdout` the original descriptor (still a terminal where it was one).
    What the thread has not copied yet is copied at exit. A child process that inherited
    descriptor 1 (multiprocessing's resource tracker, say) keeps the pipe open after this
    process closed its end: the exit waits for what is in the pipe, not for its end."""
    sys.stdout.flush()
    original = os.dup(1)
    read, write = os.pipe()
    os.dup2(write, 1)
    os.close(write)
    sys.stdout = open(original, "w", buffering=1, encoding=sys.stdout.encoding,  # noqa: SIM115 (the process's)
                      errors=sys.stdout.errors, closefd=False)
    copier = _Copier(read, original)
    thread = threading.Thread(target=copier.run, name="jaxmon-native-lines", daemon=True)
    thread.start()

    def drain() -> None:
        sys.stdout.flush()
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, 1)
        os.close(null)
        deadline = time.monotonic() + DRAIN_SECS
        while thread.is_alive() and time.monotonic() < deadline:
            if copier.waiting.is_set() and not _unread(read):
                copier.finish()
                return
            time.sleep(0.01)

    atexit.register(drain)


class _Copier:
    """Copies the lines that reach `read` to `to`, but the `DROPPED` ones. `waiting` is set
    while it waits for more with all it read written but a line's start (`pending`)."""

    def __init__(self, read: int, to: int):
        self.read, self.to = read, to
        self.pending = b""
        self.waiting = threading.Event()

    def run(self) -> None:
        while True:
            self.waiting.set()
            try:
                chunk = os.read(self.read, 65536)
            except OSError:
                return
            finally:
                self.waiting.clear()
            if not chunk:
                self.finish()
                return
            *lines, self.pending = (self.pending + chunk).split(b"\n")
            kept = b"".join(line + b"\n" for line in lines if not line.startswith(DROPPED))
            if kept:
                _write(self.to, kept)

    def finish(self) -> None:
        """Writes the last line's start, which no newline ended."""
        if self.pending and not self.pending.startswith(DROPPED):
            _write(self.to, self.pending)
        self.pending = b""


def _unread(read: int) -> int:
    """The bytes waiting in the pipe `read`."""
    return struct.unpack("i", fcntl.ioctl(read, termios.FIONREAD, b"\0\0\0\0"))[0]


def _write(to: int, data: bytes) -> None:
    try:
        os.write(to, data)
    except OSError:  # the terminal went away: nothing left to show
        pass
