"""`jaxmon train --processes N` and `jaxmon launch -n N -- COMMAND`: N processes of one
training on this machine.

The launcher starts N child processes of the same command (without `--processes`), or
of the user's COMMAND, on the CPU, connected through a coordinator on a free port of
127.0.0.1 by the `JAX_COORDINATOR_ADDRESS`, `JAX_NUM_PROCESSES` and `JAX_PROCESS_ID`
variables, as several hosts would be; each keeps the launcher's environment (`XLA_FLAGS`: how many
CPU devices each has). Process 0's output is shown as it is; each other process's goes
to `process-<i>.log` in the run's directory (or the log directory), its warnings and
errors shown too, after `[process i]`.

When a child fails (an exit code other than 0, or a signal), the launcher stops the
others (SIGTERM, then SIGKILL after `GRACE_SECS`) and exits with that child's code
(128 + the signal for a killed one); while the only children that failed lost their
peer (exit 75), it gives the others `CAUSE_SECS` to end, and names the one that died.
Ctrl-C or SIGTERM to the launcher sends SIGTERM to every child: they save at the step
they agree on and stop, and the launcher exits 130 (Ctrl-C) or 143; a second one kills
them at once.
"""

from __future__ import annotations

import datetime
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import IO

from jaxmon._base import signals as _signals
from jaxmon._base.errors import ConfigError
from jaxmon._base.paths import open_file

__all__ = ["GRACE_SECS", "LEVEL_NAMES", "launch", "processes_option", "run_processes"]

#: Seconds a child has to end after SIGTERM, once another child failed, before SIGKILL. Short: without
#: its peer a child cannot save, and one waiting in a collective or a save's barrier never ends alone.
GRACE_SECS = 5.0

#: Seconds the launcher waits, when the only children that failed so far lost a peer (exit
#: 75), for the peer that died to end too: a killed JAX process takes a moment to end (its
#: threads, under load), and its peer may notice first. The launcher then names the death.
CAUSE_SECS = 1.0

#: Set in the environment of processes 1.. : their log lines carry their level, which
#: tells the launcher the warnings and errors to show.
LEVEL_NAMES = "JAXMON_LOG_LEVEL_NAMES"

#: Lines not shown from the stderr of processes 1.. : jaxmon's INFO and DEBUG lines
#: (`12:00:00 INFO ...`, with LEVEL_NAMES) and the INFO lines of JAX's C++ logs (`I1125 ...`).
_QUIET = re.compile(r"\d\d:\d\d:\d\d (INFO|DEBUG) |I\d{4} ")


def processes_option(value: str | None, option: str = "--processes") -> int:
    """The number `--processes` (or `option`) gives (1 without it).

    Raises:
      ConfigError: `value` is not a whole number >= 1.
    """
    if value is None:
        return 1
    try:
        count = int(value)
    except ValueError:
        count = 0
    if count < 1:
        raise ConfigError(f"{option}={value!r}: give a whole number of processes >= 1 (e.g. {option} 2; "
                          "1 is a plain run).")
    return count


def run_processes(argv: Sequence[str], count: int, workdir: str, *, grace_secs: float = GRACE_SECS) -> int:
    """Runs `jaxmon` with `argv` (the command line, `--processes` dropped from it) in
    `count` child processes connected on 127.0.0.1; returns the exit code.

    Args:
      argv: the `jaxmon` arguments, as given (`train ... --processes N ...`).
      count: how many processes (2 or more).
      workdir: the run's directory, where `process-<i>.log` go.
      grace_secs: seconds between SIGTERM and SIGKILL when stopping the others.

    Raises:
      ConfigError: this process is already one of several, or `workdir` cannot be made.
    """
    return launch([sys.executable, "-m", "jaxmon", *without_processes(argv)], count, workdir, name="jaxmon train",
                  grace_secs=grace_secs, checkpoints=workdir)


def launch(command: Sequence[str], count: int, log_dir: str, *, name: str, grace_secs: float = GRACE_SECS,
           checkpoints: str | None = None) -> int:
    """Runs `command` in `count` child processes connected on 127.0.0.1 (see the module's
    docstring); returns the exit code.

    Args:
      command: the program and its arguments.
      count: how many processes (2 or more).
      log_dir: where `process-<i>.log` go (created if needed).
      name: the command that launches, for its lines (`jaxmon train`, `jaxmon launch`).
      grace_secs: seconds between SIGTERM and SIGKILL when stopping the others.
      checkpoints: the run's checkpoint directory (`jaxmon train`'s workdir): a stop by a
        signal is said in one line naming the step every process saved (the children
        say none, `signals.LAUNCHER_SAYS`); None: the command is the user's.

    Raises:
      ConfigError: this process is already one of several, or `log_dir` cannot be made.
    """
    with _signals.loading():
        from jaxmon._processes.launch import detect  # loads JAX (its cluster detection): only to launch

    cluster = detect()
    if cluster.processes > 1:
        raise ConfigError(f"{name} starts {count} processes on this machine, but this process is already one of "
                          f"{cluster.processes} ({cluster.source}): run the program without it.")
    _make_workdir(log_dir)
    address = f"127.0.0.1:{_free_port()}"
    logs = [os.path.join(log_dir, f"process-{i}.log") for i in range(count)]
    others = "process 1's" if count == 2 else f"processes 1 to {count - 1}'s"
    what = "Training" if name == "jaxmon train" else "Running"
    print(f"{what} in {count} processes on the CPU of this machine (coordinator {address}): process 0's output "
          f"follows; {others} goes to {os.path.join(log_dir, 'process-<i>.log')}, warnings and errors shown "
          "here too.", flush=True)
    sys.stderr.flush()
    return _Children(list(command), address, logs, grace_secs, name=name, checkpoints=checkpoints).run()


def without_processes(argv: Sequence[str]) -> list[str]:
    """`argv` without `--processes N` or `--processes=N` (or an abbreviation of it)."""
    kept, skip = [], False
    for arg in argv:
        name = arg.split("=", 1)[0]
        if skip:
            skip = False
        elif len(name) >= 3 and "--processes".startswith(name):
            skip = "=" not in arg
        else:
            kept.append(arg)
    return kept


class _Children:
    """The child processes of one launch: started, their output routed, watched until
    they all end."""

    def __init__(self, command: list[str], address: str, logs: list[str], grace_secs: float,
                 name: str = "jaxmon train", checkpoints: str | None = None):
        self._command, self._address, self._logs, self._grace, self._name = command, address, logs, grace_secs, name
        self._checkpoints = checkpoints
        self._processes: list[subprocess.Popen] = []
        self._signals: list[int] = []
        self._print_lock = threading.Lock()

    def run(self) -> int:
        """Starts the children and waits for them; returns the launcher's exit code."""
        previous = self._catch_signals()
        try:
            self._start()
            readers = self._route_output()
            failed, stopped_by = self._watch()
            for reader in readers:  # a grandchild (a data worker) may hold a pipe open: do not wait forever
                reader.join(timeout=5)
        finally:
            self._send(signal.SIGKILL)  # none is left running, whatever happened here
            for signum, handler in previous.items():
                signal.signal(signum, handler)
        return self._report(failed, stopped_by)

    def _catch_signals(self) -> dict[int, object]:
        """Ctrl-C and SIGTERM to the launcher are noted, and acted on by `_watch`."""
        if threading.current_thread() is not threading.main_thread():
            return {}
        return {signum: signal.signal(signum, lambda s, frame: self._signals.append(s))
                for signum in (signal.SIGINT, signal.SIGTERM)}

    def _start(self) -> None:
        count = len(self._logs)
        for i in range(count):
            env = {**os.environ, "JAX_COORDINATOR_ADDRESS": self._address, "JAX_NUM_PROCESSES": str(count),
                   "JAX_PROCESS_ID": str(i), "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1"}
            if self._checkpoints is not None:
                env[_signals.LAUNCHER_SAYS] = "1"
            pipe = None
            if i:
                env[LEVEL_NAMES] = "1"
                pipe = subprocess.PIPE
            # A session of its own: a Ctrl-C at the terminal reaches the launcher alone, which passes it on.
            self._processes.append(subprocess.Popen(self._command, env=env, stdout=pipe, stderr=pipe,
                                                    stdin=subprocess.DEVNULL, start_new_session=True,
                                                    preexec_fn=_die_with_parent()))

    def _route_output(self) -> list[threading.Thread]:
        """Threads copying the output of processes 1.. to their logs (and their stderr's
        warnings and errors to this one's stderr)."""
        readers = []
        for i, process in enumerate(self._processes[1:], start=1):
            log = open_file(self._logs[i], "a", encoding="utf-8")  # closed by the last reader; never through a link
            log.write(f"==== {datetime.datetime.now().isoformat(timespec='seconds')} process {i} of "
                      f"{len(self._processes)}: {' '.join(self._command)}\n")
            log.flush()
            lock, left = threading.Lock(), [2]
            for stream, shown in ((process.stdout, False), (process.stderr, True)):
                reader = threading.Thread(target=self._copy, args=(i, stream, log, lock, left, shown), daemon=True)
                reader.start()
                readers.append(reader)
        return readers

    def _copy(self, i: int, stream: IO[bytes], log: IO[str], lock: threading.Lock, left: list[int],
              shown: bool) -> None:
        try:
            for raw in stream:
                line = raw.decode("utf-8", "replace")
                with lock:
                    log.write(line)
                    log.flush()
                if shown and not _QUIET.match(line):
                    with self._print_lock:
                        sys.stderr.write(f"[process {i}] {line}")
                        sys.stderr.flush()
        finally:
            with lock:
                left[0] -= 1
                if not left[0]:
                    log.close()

    def _watch(self) -> tuple[int | None, int | None]:
        """Waits until every child has ended, stopping the others when one fails and
        passing on the launcher's signals; returns (the failed child, the signal that
        stopped the launcher), each None if none."""
        failed = stopped_by = kill_at = lost_at = None
        while True:
            codes = [process.poll() for process in self._processes]
            ended = all(code is not None for code in codes)
            if self._signals and not ended:
                signum = self._signals.pop(0)
                if stopped_by is None:
                    stopped_by = signum
                    self._say(f"{_signal_name(signum)}: every process saves at the step they agree on, then stops "
                              f"(SIGTERM to each); a second {_signal_name(signum)} stops them at once.")
                    self._send(signal.SIGTERM)
                else:
                    self._send(signal.SIGKILL)
            if failed is None and stopped_by is None:
                failures = [(_blame(code), i) for i, code in enumerate(codes) if code not in (None, 0)]
                if failures and not ended and min(failures)[0] == _ONLY_LOST_A_PEER:
                    if lost_at is None:
                        lost_at = time.monotonic()
                    if time.monotonic() < lost_at + CAUSE_SECS:  # the peer it lost is ending too: the cause
                        failures = []
                if failures:  # the likeliest cause when several ended in one poll
                    failed = min(failures)[1]
                    self._send(signal.SIGTERM)
                    kill_at = time.monotonic() + self._grace
            if ended:  # only now: every child may have ended, one failing, within one poll
                return failed, stopped_by
            if kill_at is not None and time.monotonic() >= kill_at:
                self._send(signal.SIGKILL)
                kill_at = None
            time.sleep(0.05)

    def _send(self, signum: int) -> None:
        for process in self._processes:
            if process.poll() is None:
                try:
                    process.send_signal(signum)
                except ProcessLookupError:
                    pass

    def _report(self, failed: int | None, stopped_by: int | None) -> int:
        """Says how the launch ended (nothing if every child succeeded); returns the exit code."""
        codes = [process.returncode for process in self._processes]
        if stopped_by is not None:
            odd = [(i, code) for i, code in enumerate(codes) if code not in (0, 130, 143)]
            if odd:
                self._say(f"stopped by {_signal_name(stopped_by)}; {self._ended(*odd[0])}.")
            else:
                self._say(self._stopped(stopped_by))
            return 128 + stopped_by
        if failed is None:
            return 0
        self._say(f"{self._ended(failed, codes[failed])}; the other processes were stopped.")
        code = codes[failed]
        return 128 - code if code < 0 else code

    def _stopped(self, signum: int) -> str:
        """The line of a stop by `signum` that every process saved at (and ended after)."""
        name = _signal_name(signum)
        if self._checkpoints is None:
            return f"stopped by {name}: every process saved and stopped; run the same command to resume."
        from jaxmon._checkpoints.step_dirs import complete_steps  # loads no JAX

        steps = complete_steps(self._checkpoints) if os.path.isdir(self._checkpoints) else []
        if not steps:
            return f"Stopped by {name} before training started: nothing to save; run the same command to train."
        step = steps[-1]
        return f"Stopped by {name} at step {step}; checkpoint {step} is saved: run the same command to resume."

    def _ended(self, i: int, code: int) -> str:
        how = f"was killed by {_signal_name(-code)}" if code < 0 else f"exited with code {code}"
        where = "its output is above" if i == 0 else f"its log is {self._logs[i]}"
        return f"process {i} of {len(self._processes)} {how} ({where})"

    def _say(self, message: str) -> None:
        with self._print_lock:
            print(f"{self._name}: {message}", file=sys.stderr, flush=True)


def _blame(code: int) -> int:
    """How likely a child's exit `code` is the cause of a failed launch, the likeliest 0:
    killed by SIGKILL (from outside: the others' errors follow from it), by another signal,
    an error of its own, and last the code of a process that only lost its peer."""
    from jaxmon._processes.agree import PEER_LOST_EXIT_CODE

    if code < 0:
        return 0 if code == -signal.SIGKILL else 1
    return _ONLY_LOST_A_PEER if code == PEER_LOST_EXIT_CODE else 2


_ONLY_LOST_A_PEER = 3  # `_blame` of a child that only lost its peer


def _signal_name(signum: int) -> str:
    if signum == signal.SIGINT:
        return "Ctrl-C"
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def _make_workdir(workdir: str) -> None:
    if os.path.exists(workdir) and not os.path.isdir(workdir):
        raise ConfigError(f"The run directory {workdir!r} is a file, not a directory: give --workdir a directory "
                          "(created if it does not exist).")
    try:
        os.makedirs(workdir, exist_ok=True)
    except OSError as error:
        raise ConfigError(f"Cannot make the run directory {workdir!r}: {error.strerror or error}; give --workdir "
                          "a directory this user can write.") from error


def _free_port() -> int:
    """A TCP port free on 127.0.0.1 just now, for the coordinator (process 0)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> Callable[[], None] | None:
    """For a child: SIGTERM when the launcher dies, even by SIGKILL (Linux's
    PR_SET_PDEATHSIG), so that no child trains on alone; None elsewhere."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    launcher = os.getpid()

    def die_with_parent() -> None:
        prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG
        if os.getppid() != launcher:  # the launcher ended before this line
            os.kill(os.getpid(), signal.SIGTERM)

    return die_with_parent
