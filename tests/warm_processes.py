"""`python -m jaxmon train ...` for the tests, forked from a process that has already
imported what `jaxmon train` imports.

Every `jaxmon train` the suite starts would first import JAX, Flax, Optax, Orbax and
tensorboardX: 1.2-1.9 s of CPU, the same in each of the suite's hundreds of runs. A warm
process (one per test process and environment, started on first use) imports them once,
before JAX starts a backend or a thread, and forks a child for each run. The child is a
real process from then on: it gets the run's environment, working directory, command
line, stdout and stderr, starts its own backend (so `XLA_FLAGS` is its own), handles its
own signals, and ends with its own exit code; what it runs is `jaxmon/__main__.py`, as
`python -m jaxmon` runs it, and jaxmon's own modules load in it. What it shares with its
warm process: the libraries' import-time state (native logging set up with the level
`jaxmon train` would give it), Python's hash seed, and the libraries' exit functions,
registered before jaxmon's (so jaxmon's last one, which ignores signals at exit, runs
first). NumPy's global generator is seeded afresh in each child.

The tests whose subject is the process's start (its first seconds, the time its imports
take, a signal during start-up or exit) start a fresh interpreter, not this; so do runs
with `--processes` (the launcher imports no JAX), and every run when
JAXMON_TESTS_FRESH_PROCESSES=1, to rule the warm processes out when a test fails.

Run as a script, this file is the warm process: it reads one request per line on stdin
(JSON: argv, cwd, env, and files for stdout and stderr), answers the child's pid and
then its wait status, one JSON line each, and ends when stdin closes.
"""

from __future__ import annotations

import contextlib
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
#: The native log level `jaxmon train` sets before JAX loads, unless --debug or the
#: environment gives one (jaxmon/_cli/main.py); JAX's C++ reads it as JAX loads.
TRAIN_LOG_LEVEL = {"TF_CPP_MIN_LOG_LEVEL": "3"}

_servers: dict[tuple[tuple[str, str], ...], subprocess.Popen] = {}
_lock = threading.Lock()


def run_jaxmon(args: list[str], *, cwd: str | os.PathLike, env: dict[str, str],
               timeout: float) -> subprocess.CompletedProcess:
    """What `subprocess.run([sys.executable, "-m", "jaxmon", *args], capture_output=True,
    text=True, cwd=cwd, env=env, timeout=timeout)` returns (or raises), stdin /dev/null:
    from a child of the warm process for `env` where the command is one of `COMMANDS`."""
    command = [sys.executable, "-m", "jaxmon", *map(str, args)]
    argv = command[3:]
    warm = (bool(argv) and argv[0] in COMMANDS and not any(arg.startswith("--processes") for arg in argv)
            and os.environ.get("JAXMON_TESTS_FRESH_PROCESSES") != "1")
    if warm and _lock.acquire(blocking=False):  # one run at a time; another thread's starts afresh
        try:
            imports_env = {**env}
            if argv[0] == "train" and "--debug" not in argv:
                imports_env = {**TRAIN_LOG_LEVEL, **env}
            with tempfile.TemporaryDirectory(prefix="jaxmon-warm-") as outputs:
                out, err = os.path.join(outputs, "stdout"), os.path.join(outputs, "stderr")
                request = {"argv": argv, "cwd": os.fspath(cwd), "env": env, "out": out, "err": err}
                status = _run_in_child(imports_env, request, timeout)
                if status is None:
                    raise subprocess.TimeoutExpired(command, timeout, _read(out) or None, _read(err) or None)
                return subprocess.CompletedProcess(command, os.waitstatus_to_exitcode(status), _text(_read(out)),
                                                   _text(_read(err)))
        finally:
            _lock.release()
    return subprocess.run(command, capture_output=True, text=True, cwd=cwd, env=env, timeout=timeout,
                          stdin=subprocess.DEVNULL)


def _run_in_child(imports_env: dict[str, str], request: dict, timeout: float) -> int | None:
    """The wait status of the child that runs `request`, forked from the warm process
    whose imports saw `imports_env`; None if it ran past `timeout` seconds (killed).
    Anything else that ends the wait (Ctrl-C) kills the child and ends its warm process,
    whose answers would no longer follow the requests."""
    key = tuple(sorted((name, value) for name, value in imports_env.items() if name not in READ_LATER))
    server = _server(key, imports_env)
    pid = None
    try:
        server.stdin.write(json.dumps(request).encode() + b"\n")
        pid = _answer(server, None)["pid"]
        try:
            return _answer(server, timeout)["status"]
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):  # it may just have ended
                os.kill(pid, signal.SIGKILL)
            status = _answer(server, None)["status"]
            return None if os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL else status
    except BaseException:
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        _end(_servers.pop(key, server))
        raise


def _server(key: tuple, imports_env: dict[str, str]) -> subprocess.Popen:
    """The warm process for `key`, started with `imports_env` (and its imports done) if
    there is none; the one used least recently ended if `KEEP` would be passed."""
    server = _servers.pop(key, None)
    if server is not None and server.poll() is None:
        _servers[key] = server  # the most recently used last
        return server
    while len(_servers) >= KEEP:
        _end(_servers.pop(next(iter(_servers))))
    # Answers unbuffered (read a byte at a time): `select` then sees every line not yet read.
    server = subprocess.Popen([sys.executable, __file__], stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0,
                              env=imports_env, cwd=pathlib.Path(__file__).parent.parent)
    try:
        _answer(server, 300)  # imported
    except BaseException:
        _end(server)
        raise
    _servers[key] = server
    return server


def _end(server: subprocess.Popen) -> None:
    """Ends a warm process: end-of-file on its requests; killed if it does not end at once."""
    with contextlib.suppress(OSError):
        server.stdin.close()
    try:
        server.wait(timeout=5)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait()


def _answer(server: subprocess.Popen, timeout: float | None) -> dict:
    """The warm process's next line; `TimeoutExpired` if none within `timeout` seconds."""
    if timeout is not None and not select.select([server.stdout], [], [], timeout)[0]:
        raise subprocess.TimeoutExpired(server.args, timeout)
    line = server.stdout.readline()
    if not line:
        raise RuntimeError(f"The warm process of tests/warm_processes.py ended (exit {server.wait()}): see "
                           "its stderr above; JAXMON_TESTS_FRESH_PROCESSES=1 starts every run afresh.")
    return json.loads(line)


def _read(path: str) -> bytes:
    with open(path, "rb") as file:
        return file.read()


def _text(data: bytes) -> str:
    """A captured stream as `subprocess.run(..., text=True)` returns it."""
    return data.decode(locale.getpreferredencoding(False)).replace("\r\n", "\n").replace("\r", "\n")


# -- the warm process ------------------------------------------------------------------------------

def _serve() -> None:
    """Imports `PRELOAD`, then forks a child for each request on stdin and answers its pid
    and its wait status on stdout, until stdin ends."""
    import importlib

    before = dict(os.environ)
    for name in PRELOAD:
        importlib.import_module(name)
    # What the imports set in the environment (JAX's default log level, say), as their setdefaults
    # would have in a fresh process: each child sets them the same way after taking the request's.
    added = {name: value for name, value in os.environ.items() if name not in before}
    sys.stdout.flush()
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # what anything else prints goes to stderr, not among the answers
    print(json.dumps({"ready": True}), file=answers, flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        request["env"] = {**added, **request["env"]}
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

        import numpy as np

        np.random.seed()  # from the OS's entropy, as NumPy's import seeds it in a fresh process

        # As `python -m jaxmon ARGV` starts: argv[0] is "-m" while the module is found
        # (jaxmon's signal layer reads it, and sys.orig_argv, as it loads), the working
        # directory first on the path, and a fresh __main__ to run the module in.
        sys.argv, sys.orig_argv = ["-m", *request["argv"]], [sys.executable, "-m", "jaxmon", *request["argv"]]
        sys.path[0] = os.getcwd()
        sys.modules["__main__"] = types.ModuleType("__main__")
        try:
            runpy._run_module_as_main("jaxmon")  # what the interpreter calls for -m
            code = 0
        except SystemExit as ended:  # as the interpreter ends on `sys.exit(code)`
            code = _exit_code(ended.code)
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
    """The exit status of `sys.exit(code)`; a code that is no number is printed, status 1."""
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
