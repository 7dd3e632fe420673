"""Lines native libraries print on the process's standard output that a run does not
need: Gloo's `[Gloo] Rank 0 is connected to 1 peer ranks...` once per process and
communicator (a C++ `std::cout` no flag turns off). `jaxmon train` drops them unless
`--debug`; Python's own output goes on to the terminal as it was."""

from __future__ import annotations

import atexit
import os
import select
import sys
import threading

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
        copier.close()
        thread.join(timeout=DRAIN_SECS)

    atexit.register(drain)


class _Copier:
    """Copies the lines that reach `read` to `to`, but the `DROPPED` ones, until the pipe
    ends or, after `close()`, holds nothing more."""

    def __init__(self, read: int, to: int):
        self.read, self.to = read, to
        self._wake_read, self._wake_write = os.pipe()

    def close(self) -> None:
        """Ends the copy once what is in the pipe now is copied (what this process wrote
        to it is there: a pipe's write returns once its bytes are in the pipe)."""
        os.write(self._wake_write, b"x")

    def run(self) -> None:
        pending = b""
        while True:
            ready, _, _ = select.select([self.read, self._wake_read], [], [])
            if self.read not in ready:  # woken by close(), with the pipe empty
                break
            try:
                chunk = os.read(self.read, 65536)
            except OSError:
                break
            if not chunk:
                break
            *lines, pending = (pending + chunk).split(b"\n")
            kept = b"".join(line + b"\n" for line in lines if not line.startswith(DROPPED))
            if kept:
                _write(self.to, kept)
        if pending and not pending.startswith(DROPPED):  # a last line that no newline ended
            _write(self.to, pending)


def _write(to: int, data: bytes) -> None:
    try:
        os.write(to, data)
    except OSError:  # the terminal went away: nothing left to show
        pass
