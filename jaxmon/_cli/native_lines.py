"""Lines native libraries print on the process's standard output that a run does not
need: Gloo's `[Gloo] Rank 0 is connected to 1 peer ranks...` once per process and
communicator (a C++ `std::cout` no flag turns off). `jaxmon train` drops them unless
`--debug`; Python's own output goes on to the terminal as it was."""

from __future__ import annotations

import atexit
import os
import sys
import threading

#: The starts of the native lines dropped.
DROPPED = (b"[Gloo] ",)


def drop_native_lines() -> None:
    """Sends file descriptor 1 through a thread that drops the `DROPPED` lines, and gives
    Python's `sys.stdout` the original descriptor (still a terminal where it was one).
    What the thread has not copied yet is copied at exit."""
    sys.stdout.flush()
    original = os.dup(1)
    read, write = os.pipe()
    os.dup2(write, 1)
    os.close(write)
    sys.stdout = open(original, "w", buffering=1, encoding=sys.stdout.encoding,  # noqa: SIM115 (the process's)
                      errors=sys.stdout.errors, closefd=False)
    copier = threading.Thread(target=_copy, args=(read, original), name="jaxmon-native-lines", daemon=True)
    copier.start()

    def drain() -> None:  # no writer is left on the pipe once descriptor 1 is closed: the copier ends
        sys.stdout.flush()
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, 1)
        os.close(null)
        copier.join(timeout=2)

    atexit.register(drain)


def _copy(read: int, to: int) -> None:
    """Copies the lines that reach `read` to `to`, but the `DROPPED` ones."""
    pending = b""
    while True:
        try:
            chunk = os.read(read, 65536)
        except OSError:
            return
        if not chunk:
            if pending:
                _write(to, pending)
            return
        *lines, pending = (pending + chunk).split(b"\n")
        kept = b"".join(line + b"\n" for line in lines if not line.startswith(DROPPED))
        if kept:
            _write(to, kept)


def _write(to: int, data: bytes) -> None:
    try:
        os.write(to, data)
    except OSError:  # the terminal went away: nothing left to show
        pass
