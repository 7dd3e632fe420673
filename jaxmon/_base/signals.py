"""Ctrl-C, SIGTERM and SIGHUP in the `jaxmon` command, from its first moment to its exit.

Importing this module in the `jaxmon` command (`jaxmon ...` or `python -m jaxmon ...`;
`jaxmon/__init__.py` imports it first, before JAX loads) installs handlers for the
three (SIGHUP, a closed terminal or a dropped SSH session, acts as SIGTERM does, with
its own words and exit code 129; under `nohup` it stays ignored):

- start-up, until `main` takes over, and while `main` loads JAX (`loading()`): nothing
  has been done yet, so a signal ends the process at once with one line (exit 130 for
  Ctrl-C, 143 for SIGTERM, 129 for SIGHUP);
- in `main` (`handling()`): a signal raises `KeyboardInterrupt` (Ctrl-C) or `Terminated`
  (SIGTERM, SIGHUP) in the main thread, so that what is open closes on the way out; a
  session inside its `with` block takes the signals over and saves first. One that Python
  swallows (raised while a garbage-collection callback or a `__del__` runs: "Exception
  ignored in ...") is raised again 50 ms later, wherever the main thread is then, or
  handed to the handler that took the signal over since; one that a library caught
  (native code run inside an import catches what it calls) goes to the session that
  takes the signal over next (`take_lost`), else stops the command when `main` ends
  (`check()`): a signal is never lost;
- once `main` knows it is stopping (`stopped()`), a signal is ignored: its last line
  is on its way. After `main` returned, a signal ends the process at once with one line;
  after the last exit function, while Python tears itself down, it is ignored (the
  command has finished).

Importing it anywhere else changes nothing.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

#: The exit code of a stop by each signal (128 + its number).
EXIT_CODES = {signal.SIGINT: 130, signal.SIGTERM: 143, signal.SIGHUP: 129}
#: The words for each signal in the command's last line.
NAMES = {signal.SIGINT: "Ctrl-C", signal.SIGTERM: "SIGTERM", signal.SIGHUP: "SIGHUP"}
#: Set by `jaxmon train --processes N` in its children's environment: the launcher says how
#: a stop by a signal ended, in one line for all of them, so a child says none of its own.
LAUNCHER_SAYS = "JAXMON_LAUNCHER_SAYS_STOP"
_AGAIN_SECS = 0.05


class Terminated(BaseException):
    """SIGTERM or SIGHUP (`signum`) in the `jaxmon` command where no session handles it:
    stops the command as `KeyboardInterrupt` does for Ctrl-C (a `BaseException`: `except
    Exception` lets it by)."""

    def __init__(self, *args: Any, signum: int = signal.SIGTERM):
        super().__init__(*args)
        self.signum = signum


class _Stage:
    """Where the command is: "off" (not the command, or not yet), "start-up", "main"
    (raising), "ending"; the signal raised and not yet acknowledged, and its exception."""

    name = "off"
    command = False  # this process is the `jaxmon` command
    pending: int | None = None
    raised: BaseException | None = None
    hook: Any = sys.unraisablehook
    alarm: Any = None  # SIGALRM's handler before `_again`, once installed


_stage = _Stage()


def _is_the_command() -> bool:
    """Whether this process is the `jaxmon` command: `python -m jaxmon ...` (while a
    module run by -m is located, `sys.argv[0]` is "-m"), or the `jaxmon` script."""
    if sys.argv[:1] == ["-m"]:
        return _module_run_by_m() == "jaxmon"
    script, main = sys.argv[0] if sys.argv else "", getattr(sys.modules.get("__main__"), "__file__", None)
    return os.path.basename(script) == "jaxmon" and bool(main) and os.path.abspath(main) == os.path.abspath(script)


def _module_run_by_m() -> str | None:
    """The MODULE of `python ... -m MODULE` in `sys.orig_argv`; None if there is none."""
    argv = list(getattr(sys, "orig_argv", []))
    i = 1
    while i < len(argv):
        arg = argv[i]
        if arg == "-m":
            return argv[i + 1] if i + 1 < len(argv) else None
        if arg.startswith("-m"):
            return arg[2:]
        if not arg.startswith("-") or arg in ("-c", "-"):
            return None
        i += 2 if arg in ("-X", "-W") else 1
    return None


def _command() -> str:
    """The command's name for its last line: `jaxmon train`, `jaxmon inspect`, ..."""
    words = [arg for arg in sys.argv[1:] if not arg.startswith("-")]
    return f"jaxmon {words[0]}" if words and words[0] in ("train", "inspect", "plot", "check", "launch") else "jaxmon"


def _install(handler: Any) -> dict[int, Any]:
    """`handler` for SIGINT, SIGTERM and SIGHUP (one ignored from the start, as a shell's
    background job leaves SIGINT and `nohup` SIGHUP, stays ignored); returns the
    handlers before."""
    previous = {}
    for signum in EXIT_CODES:
        current = signal.getsignal(signum)
        if current is not signal.SIG_IGN:
            previous[signum] = signal.signal(signum, handler)
    return previous


def flush_std_streams() -> None:
    """Flushes Python's stdout and stderr before the process ends with `os._exit`."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # a closed stream: nothing to flush
            pass


class _LastLines:
    """The real stderr once `write_last_line` has pointed fd 2 at the null device, and the
    lock that keeps two threads' last lines (the main thread's and the coordination
    client's) whole and both on it."""

    lock = threading.Lock()
    stderr: int | None = None


_last_lines = _LastLines()


def write_last_line(text: str) -> None:
    """Writes `text` to stderr as the process's last output: stderr (fd 2) is pointed at
    the null device first, so that what another thread writes from here on (a native
    log line from JAX's coordination client, say, in the few milliseconds before the
    process ends) cannot come after it; a write begun before is given 50 ms to land.
    For a process about to end: Python's `sys.stderr` writes nowhere after this, and
    Ctrl-C, SIGTERM or SIGHUP from here on is ignored (the line is on its way). A second
    last line, from another thread, comes after the first on the real stderr."""
    if _stage.name == "main":
        _stage.name = "ending"
    flush_std_streams()
    with _last_lines.lock:
        if _last_lines.stderr is None:
            _last_lines.stderr = _quiet_stderr()
        try:
            os.write(_last_lines.stderr, text.encode(errors="replace"))
        except OSError:  # stderr closed: the exit code still says it
            pass


def _quiet_stderr() -> int:
    """Points fd 2 at the null device; returns a descriptor of the stderr before (2 itself
    where there is none to save)."""
    try:
        saved = os.dup(2)
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, 2)
        os.close(null)
        time.sleep(0.05)  # for a write that another thread had begun on the old stderr to land first
    except OSError:  # no stderr to save: it goes where it can
        return 2
    return saved


def launcher_says() -> bool:
    """Whether this process is a child of `jaxmon train --processes N`, whose launcher says
    how a stop ended (see `LAUNCHER_SAYS`)."""
    return os.environ.get(LAUNCHER_SAYS) == "1"


def _exit_at_once(signum: int, frame: Any) -> None:
    """A signal before `main` runs, or after it ended: one line, then exit."""
    if launcher_says():
        os._exit(EXIT_CODES[signum])
    if _stage.name == "start-up":
        what = ("before training started: nothing to save; run the same command to train."
                if _command() == "jaxmon train" else "while starting: nothing was done.")
    else:
        what = "while exiting: the command had finished."
    os.write(2, f"{_command()}: Stopped by {NAMES[signum]} {what}\n".encode())
    os._exit(EXIT_CODES[signum])


def _raise(signum: int, frame: Any) -> None:
    """A signal in `main`: raises `KeyboardInterrupt` or `Terminated` where the main thread is."""
    if _stage.name != "main":  # the command is ending: its last line is on its way
        return
    _stage.pending = signum
    _stage.raised = error = KeyboardInterrupt() if signum == signal.SIGINT else Terminated(signum=signum)
    raise error


def _unraisable(unraisable: Any) -> None:
    """`sys.unraisablehook`: our exception swallowed (raised inside a garbage-collection
    callback or a `__del__`) is raised again shortly; any other goes to the hook before."""
    if unraisable.exc_value is not None and unraisable.exc_value is _stage.raised and _stage.name == "main":
        if _stage.alarm is None:
            _stage.alarm = signal.signal(signal.SIGALRM, _again)
        signal.setitimer(signal.ITIMER_REAL, _AGAIN_SECS)
        return
    _stage.hook(unraisable)


def _again(signum: int, frame: Any) -> None:
    """SIGALRM after a swallowed signal: raises it again, or hands it to the handler that
    took the signal over since (a session's, which saves first)."""
    pending = _stage.pending
    if _stage.name != "main" or pending is None:
        return
    if signal.getsignal(pending) is _raise:
        _raise(pending, frame)
    _stage.pending = _stage.raised = None
    os.kill(os.getpid(), pending)


def install_for_the_command() -> None:
    """Handles the signals from here on if this process is the `jaxmon` command."""
    if _stage.name == "off" and threading.current_thread() is threading.main_thread() and _is_the_command():
        _stage.name, _stage.command = "start-up", True
        _install(_exit_at_once)
        atexit.register(_ignore_signals)  # registered first, so it runs after the other exit functions


def _ignore_signals() -> None:
    """The last exit function: the signals are ignored from here on. Python would give
    them their default action (death by the signal, silently) while it tears itself down
    (a second or so, after a command that has finished)."""
    for signum in EXIT_CODES:
        signal.signal(signum, signal.SIG_IGN)


@contextlib.contextmanager
def handling() -> Iterator[None]:
    """`main`'s: a signal raises `KeyboardInterrupt` (Ctrl-C) or `Terminated` (SIGTERM)
    where the main thread is, and never gets lost; afterwards the handlers before are
    back (in the command: exit at once)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before, _stage.hook = _stage.name, sys.unraisablehook
    previous = _install(_raise)
    sys.unraisablehook = _unraisable
    _stage.name, _stage.pending, _stage.raised = "main", None, None
    try:
        yield
    finally:
        _stage.name = "ending" if before != "off" else "off"
        if _stage.alarm is not None:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, _stage.alarm)
            _stage.alarm = None
        sys.unraisablehook = _stage.hook
        for signum, handler in previous.items():
            signal.signal(signum, handler)


@contextlib.contextmanager
def loading() -> Iterator[None]:
    """Around `main`'s imports that load JAX and the libraries with it: a signal ends the
    process at once with the start-up line, as one during `import jaxmon` would. Raised
    inside a native extension's initialisation, the exception could leave it half made,
    and the process would crash on its way out instead of saying it stopped."""
    if _stage.name != "main" or not _stage.command:  # `main` called in a program of its own
        yield
        return
    with _held():  # a signal in between waits: the handler and the words change together
        previous = _install(_exit_at_once)
        _stage.name = "start-up"  # `_exit_at_once`'s words: nothing done yet
    try:
        yield
    finally:
        with _held():
            _stage.name = "main"
            for signum, handler in previous.items():
                signal.signal(signum, handler)


@contextlib.contextmanager
def _held() -> Iterator[None]:
    """Ctrl-C, SIGTERM and SIGHUP held back (blocked) inside, delivered on the way out."""
    held = signal.pthread_sigmask(signal.SIG_BLOCK, EXIT_CODES)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)


def take_lost(signum: int) -> bool:
    """Whether `signum` raised its exception in `main` and nothing has acknowledged it
    since: a library caught it on the way (native code run inside an import, say). A
    handler that takes the signal over (a session's) asks when it is installed and, if
    so, acts on the signal itself; the signal is then no longer this module's."""
    if _stage.name == "main" and _stage.pending == signum:
        _stage.pending = _stage.raised = None
        return True
    return False


def in_the_command() -> bool:
    """Whether this is the `jaxmon` command and `main` is running (not loading JAX, not ending)."""
    return _stage.command and _stage.name == "main"


def check() -> None:
    """Raises the signal's exception if one came and was lost on the way (a library
    caught it): the command then stops as it would have."""
    if _stage.name == "main" and _stage.pending is not None:
        _raise(_stage.pending, None)


def stopped(error: BaseException) -> int | None:
    """The signal that `error` (reaching `main`) comes from, if one does: the signal
    raised and not yet acknowledged (whatever became of its exception: a library may
    have wrapped it), else `KeyboardInterrupt` or `Terminated` itself. Once there is
    one, later signals are ignored: the command is writing its last line."""
    signum = _stage.pending
    if signum is None:
        signum = (signal.SIGINT if isinstance(error, KeyboardInterrupt)
                  else error.signum if isinstance(error, Terminated) else None)
    if signum is not None and _stage.name == "main":
        _stage.name = "ending"  # `_again`, if it comes, does nothing now
    return signum


install_for_the_command()
