"""`python -m jaxmon train ...` for the tests, forked from a process that has already
imported what `jaxmon train` imports.

Every `jaxmon train` the suite starts would first import JAX, Flax, Optax, Orbax and
tensorboardX: 1.2-1.9 s of CPU, the same in each of the suite's hundreds of runs. A warm
process (one per test process and environment, started on first use) imports them once,
before JAX starts a backend or a thread, and forks a child for each run. The child is a
real process from then on: it gets the run's environment, working directory, command
line, stdout and stderr, starts its own backend (so `XLA_FLAGS` is its own), handles its
own signals, and ends with its own exit code; what it runs is `jaxmon/__main__.py`, as
`python -m jaxmon` runs it. Only the imports happened before it was born.

The tests whose subject is the process's start (its first seconds, the time its imports
take, a signal during start-up) start a fresh interpreter, not this. So does every run
when JAXMON_TESTS_FRESH_PROCESSES=1, to check that the two agree.

Run as a script, this file is the warm process: it reads one request per line on stdin
(JSON: argv, cwd, env, and files for stdout and stderr), answers the child's pid and
then its wait status, one JSON line each, and ends when stdin closes.
"""

from __future__ import annotations

import json
import locale
import os
import pathlib
import select
import signal
import subprocess
import sys
import tempfile
import threading

#: The libraries `jaxmon train` imports, imported once by the warm process. Not jaxmon's
#: own modules: what they do as they load (the command's signal handlers, say) depends on
#: the process's command line and environment, and happens in each child as in a fresh
#: process.
PRELOAD = ("jax", "flax.linen", "optax", "orbax.checkpoint", "tensorboardX")
#: The commands that import those libraries; the others start afresh.
COMMANDS = ("train", "check")
#: Warm processes kept per test process (one per environment, the oldest ended first).
KEEP = 3
#: Read after the imports (by pytest, or by XLA as a backend starts): a warm process serves
#: environments that differ in these alone, and its child gets the request's.
READ_LATER = ("PYTEST_CURRENT_TEST", "XLA_FLAGS")

_servers: dict[tuple[tuple[str, str], ...], subprocess.Popen] = {}
_lock = threading.Lock()


def run_jaxmon(args: list[str], *, cwd: str | os.PathLike, env: dict[str, str],
               timeout: float) -> subprocess.CompletedProcess:
    """What `subprocess.run([sys.executable, "-m", "jaxmon", *args], capture_output=True,
    text=True, cwd=cwd, env=env, timeout=timeout)` returns (or raises), stdin /dev/null:
    from a child of the warm process for `env` where the command is one of `COMMANDS`."""
    command = [sys.executable, "-m", "jaxmon", *map(str, args)]
    warm = command[3] in COMMANDS if len(command) > 3 else False
    # One run at a time through the warm processes: a second thread's starts afresh.
    if not warm or os.environ.get("JAXMON_TESTS_FRESH_PROCESSES") == "1" or not _lock.acquire(blocking=False):
        return subprocess.run(command, capture_output=True, text=True, cwd=cwd, env=env, timeout=timeout,
                              stdin=subprocess.DEVNULL)
    try:
        with tempfile.TemporaryDirectory(prefix="jaxmon-warm-") as outputs:
            out, err = os.path.join(outputs, "stdout"), os.path.join(outputs, "stderr")
            status = _run_in_child(_server(env), {"argv": command[3:], "cwd": os.fspath(cwd), "env": env,
                                                  "out": out, "err": err}, timeout)
            if status is None:
                raise subprocess.TimeoutExpired(command, timeout, _text(out), _text(err))
            return subprocess.CompletedProcess(command, os.waitstatus_to_exitcode(status), _text(out), _text(err))
    finally:
        _lock.release()


def _run_in_child(server: subprocess.Popen, request: dict, timeout: float) -> int | None:
    """The wait status of the child that runs `request`; None if it ran past `timeout`
    seconds (killed). Anything else that ends the wait (Ctrl-C) kills the child and ends
    its warm process, whose answers would no longer follow the requests."""
    server.stdin.write(json.dumps(request).encode() + b"\n")
    pid = _answer(server, None)["pid"]
    try:
        return _answer(server, timeout)["status"]
    except subprocess.TimeoutExpired:
        os.kill(pid, signal.SIGKILL)
        _answer(server, None)
        return None
    except BaseException:
        os.kill(pid, signal.SIGKILL)
        _servers.pop(next(key for key, value in _servers.items() if value is server), None)
        server.stdin.close()
        raise


def _server(env: dict[str, str]) -> subprocess.Popen:
    """The warm process for `env`, started (and its imports done) if there is none."""
    key = tuple(sorted((name, value) for name, value in env.items() if name not in READ_LATER))
    server = _servers.get(key)
    if server is not None and server.poll() is None:
        return server
    while len(_servers) >= KEEP:
        _servers.pop(next(iter(_servers))).stdin.close()  # the oldest reads end-of-file and ends
    # Answers unbuffered (read a byte at a time): `select` then sees every line not yet read.
    server = subprocess.Popen([sys.executable, __file__], stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0,
                              env=env, cwd=pathlib.Path(__file__).parent.parent)
    _answer(server, 300)  # imported
    _servers[key] = server
    return server


def _answer(server: subprocess.Popen, timeout: float | None) -> dict:
    """The warm process's next line; `TimeoutExpired` if none within `timeout` seconds."""
    if timeout is not None and not select.select([server.stdout], [], [], timeout)[0]:
        raise subprocess.TimeoutExpired("the warm process", timeout)
    line = server.stdout.readline()
    if not line:
        raise RuntimeError(f"The warm process of tests/warm_processes.py ended (exit {server.wait()}): see "
                           "its stderr above; JAXMON_TESTS_FRESH_PROCESSES=1 starts every run afresh.")
    return json.loads(line)


def _text(path: str) -> str:
    """A captured stream as `subprocess.run(..., text=True)` returns it."""
    with open(path, "rb") as file:
        data = file.read()
    return data.decode(locale.getpreferredencoding(False)).replace("\r\n", "\n").replace("\r", "\n")


# -- the warm process ------------------------------------------------------------------------------

def _serve() -> None:
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # what anything else prints goes to stderr, not among the answers
    print(json.dumps({"ready": True}), file=answers, flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _child(request)  # never returns
        print(json.dumps({"pid": pid}), file=answers, flush=True)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"status": status}), file=answers, flush=True)


def _child(request: dict) -> None:
    """Becomes `python -m jaxmon ARGV` in `cwd` with `env`, stdout and stderr to files."""
    code = 1
    try:
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        for fd, path, flags in ((0, os.devnull, os.O_RDONLY), (1, request["out"], os.O_WRONLY | os.O_CREAT),
                                (2, request["err"], os.O_WRONLY | os.O_CREAT)):
            opened = os.open(path, flags, 0o600)
            os.dup2(opened, fd)
            os.close(opened)
        os.closerange(3, 1 << 16)  # as subprocess's close_fds: the request pipe and the answer file
        _fresh_std_streams()
        import runpy
        import types

        # As `python -m jaxmon ARGV` starts: argv[0] is "-m" while the module is found
        # (jaxmon's signal layer reads it, and sys.orig_argv, as it loads), the working
        # directory first on the path, and a fresh __main__ to run the module in.
        sys.argv, sys.orig_argv = ["-m", *request["argv"]], [sys.executable, "-m", "jaxmon", *request["argv"]]
        sys.path[0] = os.getcwd()
        sys.modules["__main__"] = types.ModuleType("__main__")
        try:
            runpy._run_module_as_main("jaxmon")  # what the interpreter calls for -m
            code = 0
        except SystemExit as exit:  # as the interpreter ends on `sys.exit(code)`
            code = _exit_code(exit.code)
        except KeyboardInterrupt:  # an uncaught Ctrl-C ends the process by SIGINT, as Python's own
            _python_exit()
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
        except BaseException:
            sys.excepthook(*sys.exc_info())
        _python_exit()
    finally:
        os._exit(code)


def _fresh_std_streams() -> None:
    """sys.stdin, stdout and stderr as a new interpreter makes them on these descriptors."""
    import io

    unbuffered = bool(os.environ.get("PYTHONUNBUFFERED"))
    streams = []
    for fd, mode in ((0, "rb"), (1, "wb"), (2, "wb")):
        raw = io.FileIO(fd, mode[0], closefd=False)
        binary = raw if unbuffered and fd else (io.BufferedReader(raw) if fd == 0 else io.BufferedWriter(raw))
        buffered = not unbuffered or fd == 0
        streams.append(io.TextIOWrapper(binary, encoding=sys.stdout.encoding, errors="backslashreplace" if fd == 2
                                        else sys.stdout.errors, line_buffering=buffered and (fd == 2 or raw.isatty()),
                                        write_through=not buffered))
    sys.stdin = sys.__stdin__ = streams[0]
    sys.stdout = sys.__stdout__ = streams[1]
    sys.stderr = sys.__stderr__ = streams[2]


def _exit_code(code: object) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def _python_exit() -> None:
    """What the interpreter does as it ends: the threads joined, the exit functions run,
    the standard streams flushed."""
    import atexit

    threading._shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass


if __name__ == "__main__":
    _serve()
