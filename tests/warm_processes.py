"""`subprocess.Popen` and `subprocess.run` for the tests' `python -m jaxmon train ...` and
`python SCRIPT.py ...`, forked from a process that has already imported what they import.

Every `jaxmon train` the suite starts, and every script that trains, would first import
JAX, Flax, Optax, Orbax and tensorboardX: 1.2-1.9 s of CPU, the same in each of the
suite's hundreds of processes. A warm process (one per test process and values of the
variables read at import, `READ_AT_IMPORT`, started on first use) imports them once,
before JAX starts a backend or a thread, and forks a child for each run, through a child
of its own that ends at once: the run's process, orphaned, is adopted by the test process
(Linux's child subreaper) and waits until it is, so that it is the test's child from its
first line, as a fresh one is. It gets the run's environment, working directory, command
line and the streams `subprocess.Popen` made for it, starts its own backend (so
`XLA_FLAGS` is its own), handles its own signals, and ends with its own exit code; what
it runs is the module or script, as the interpreter runs it, and jaxmon's own modules
load in it. What it shares with its warm process: the libraries' import-time state
(native logging set up with the level `jaxmon train` would give it, absl's logging),
Python's hash seed, and the libraries' exit functions, registered before jaxmon's (so
jaxmon's last one, which ignores signals at exit, runs first). NumPy's global generator
is seeded afresh in each child.

The tests whose subject is the process's start (its first seconds, the time its imports
take, a signal during start-up or exit, logging set up as the libraries load) use
`subprocess`, not this; so do runs with `--processes` (the launcher imports no JAX), and
every run when JAXMON_TESTS_FRESH_PROCESSES=1, to rule the warm processes out when a test
fails.

Run as a script, this file is the warm process: it reads requests (JSON: args, cwd, env,
with the child's stdin, stdout and stderr as descriptors) on the socket its argument
names, answers each with the child's pid, and ends when the socket closes.
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import threading
import time
import typing

#: The libraries `jaxmon train` imports, imported once by the warm process. Not jaxmon's
#: own modules: what they do as they load (the command's signal handlers, say) depends on
#: the process's command line and environment, and happens in each child as in a fresh
#: process.
PRELOAD = ("jax", "flax.linen", "optax", "orbax.checkpoint", "tensorboardX")
#: The commands that import those libraries; the others start afresh.
COMMANDS = ("train", "check")
#: The arguments of `subprocess.Popen` a warm process's child can take.
WARM_ARGUMENTS = {"stdin", "stdout", "stderr", "cwd", "env", "text", "start_new_session"}
#: Warm processes kept per test process (one per values of `READ_AT_IMPORT`, the oldest ended first).
KEEP = 3
#: The variables the interpreter and the libraries of `PRELOAD` may read as they load (by
#: the start of their names): a warm process serves the environments that agree on these.
#: Its child gets the request's whole environment before anything else loads, and makes
#: its path from the request's PYTHONPATH and its streams by its PYTHONUNBUFFERED.
READ_AT_IMPORT = ("PYTHON", "JAX_", "TF_", "XLA_", "FLAX_", "ORBAX", "ABSL", "NUMPY", "NPY_", "OMP_", "OPENBLAS",
                  "MKL_", "LD_", "CUDA", "TPU_", "GRPC_", "TENSORBOARD", "TENSORSTORE", "PROTOCOL_BUFFERS", "LANG",
                  "LC_", "TZ")
#: Of those, read later (by XLA as a backend starts, by JAX and jaxmon as the processes of
#: a run connect) or set in the child as it starts.
READ_LATER = ("XLA_FLAGS", "JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID", "PYTHONPATH",
              "PYTHONUNBUFFERED")
#: The native log level `jaxmon train` sets before JAX loads, unless --debug or the
#: environment gives one (jaxmon/_cli/main.py); JAX's C++ reads it as JAX loads.
TRAIN_LOG_LEVEL = {"TF_CPP_MIN_LOG_LEVEL": "3"}

_servers: dict[tuple[tuple[str, str], ...], _Server] = {}
_lock = threading.Lock()
#: Linux's prctl option that makes a process adopt its descendants' orphans.
_PR_SET_CHILD_SUBREAPER = 36


def popen(command: list, **kwargs) -> subprocess.Popen:
    """`subprocess.Popen(command, **kwargs)`. Where `command` is `[sys.executable, "-m",
    "jaxmon", COMMAND, ...]` (COMMAND one of `COMMANDS`) or `[sys.executable, SCRIPT.py,
    ...]` and `kwargs` name only `WARM_ARGUMENTS`, the child is forked from the warm process
    for its environment and adopted by this process: its child as a fresh one is (`wait`,
    `poll`, `send_signal`, `communicate` as for any)."""
    command = [os.fspath(arg) if isinstance(arg, os.PathLike) else arg for arg in command]
    if _warm(command, kwargs):
        return _WarmPopen(command, **kwargs)
    return subprocess.Popen(command, **kwargs)


def run(command: list, *, input: str | bytes | None = None, capture_output: bool = False,
        timeout: float | None = None, check: bool = False, **kwargs) -> subprocess.CompletedProcess:
    """`subprocess.run(command, ...)`, its child from `popen`."""
    if input is not None:
        kwargs["stdin"] = subprocess.PIPE
    if capture_output:
        kwargs["stdout"] = kwargs["stderr"] = subprocess.PIPE
    with popen(command, **kwargs) as process:
        try:
            out, err = process.communicate(input, timeout=timeout)
        except BaseException:  # as subprocess.run: killed, waited for, raised (with its output if timed out)
            process.kill()
            process.wait()
            raise
    if check and process.returncode:
        raise subprocess.CalledProcessError(process.returncode, process.args, out, err)
    return subprocess.CompletedProcess(process.args, process.returncode, out, err)


def run_jaxmon(args: list, *, cwd: str | os.PathLike, env: dict[str, str],
               timeout: float) -> subprocess.CompletedProcess:
    """`run([sys.executable, "-m", "jaxmon", *args], capture_output=True, text=True, ...)`,
    stdin /dev/null."""
    return run([sys.executable, "-m", "jaxmon", *map(str, args)], capture_output=True, text=True, timeout=timeout,
               stdin=subprocess.DEVNULL, cwd=cwd, env=env)


def _warm(command: list, kwargs: dict) -> bool:
    """Whether `popen` forks `command` from a warm process."""
    if (command[:1] != [sys.executable] or not set(kwargs) <= WARM_ARGUMENTS
            or os.environ.get("JAXMON_TESTS_FRESH_PROCESSES") == "1" or not _CAN_ADOPT):
        return False
    args = command[1:]
    if args[:2] == ["-m", "jaxmon"]:
        return len(args) > 2 and args[2] in COMMANDS and not any(arg.startswith("--processes") for arg in args)
    return bool(args) and args[0].endswith(".py")


class _WarmPopen(subprocess.Popen):
    """A `subprocess.Popen` whose child a warm process forks, with the streams Popen made."""

    def __init__(self, command: list, *, start_new_session: bool = False, **kwargs):
        self._new_session = start_new_session
        super().__init__(command, **kwargs)

    def _execute_child(self, args, executable, preexec_fn, close_fds, pass_fds, cwd, env, startupinfo,
                       creationflags, shell, p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite, *rest):
        try:
            streams = [own if fd == -1 else fd for own, fd in enumerate((p2cread, c2pwrite, errwrite))]
            request = {"args": args[1:], "cwd": os.path.abspath(cwd if cwd is not None else os.getcwd()),
                       "env": dict(os.environ if env is None else env), "new_session": self._new_session,
                       "requester": os.getpid()}
            self.pid = _fork(request, streams)
            self._child_created = True
        finally:
            self._close_pipe_fds(p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite)


def _fork(request: dict, streams: list[int]) -> int:
    """The pid of the child, now this process's, that the warm process for `request`'s
    environment forked to run it on `streams` (its stdin, stdout and stderr)."""
    args, env = request["args"], request["env"]
    train = args[:3] == ["-m", "jaxmon", "train"] and "--debug" not in args
    imports_env = {**TRAIN_LOG_LEVEL, **env} if train else env
    key = tuple(sorted((name, value) for name, value in imports_env.items()
                       if name.startswith(READ_AT_IMPORT) and name not in READ_LATER))
    with _lock:
        server = _server(key, imports_env)
        try:
            _adopt_orphans(True)  # the child is orphaned as it starts; this process adopts it
            try:
                socket.send_fds(server.channel, [json.dumps(request).encode()], streams)
                return _answer(server, 60)["pid"]
            finally:
                _adopt_orphans(False)
        except BaseException as error:
            _end(_servers.pop(key, server))
            if isinstance(error, subprocess.TimeoutExpired):  # not the child's timeout: its warm process's
                raise RuntimeError("The warm process of tests/warm_processes.py did not answer in 60 s; "
                                   "JAXMON_TESTS_FRESH_PROCESSES=1 starts every run afresh.") from None
            raise


def _adopt_orphans(adopt: bool) -> bool:
    """Whether this process now adopts its descendants' orphans (or no longer does), as
    Linux's child subreaper; False where it cannot."""
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, int(adopt), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


_CAN_ADOPT = sys.platform.startswith("linux") and _adopt_orphans(False)


class _Server(typing.NamedTuple):
    process: subprocess.Popen
    channel: socket.socket  # requests with their streams, answers


def _server(key: tuple, imports_env: dict[str, str]) -> _Server:
    """The warm process for `key`, started with `imports_env` (and its imports done) if
    there is none; the one used least recently ended if `KEEP` would be passed."""
    server = _servers.pop(key, None)
    if server is not None and server.process.poll() is None:
        _servers[key] = server  # the most recently used last
        return server
    while len(_servers) >= KEEP:
        _end(_servers.pop(next(iter(_servers))))
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    with theirs:
        process = subprocess.Popen([sys.executable, __file__, str(theirs.fileno())], pass_fds=[theirs.fileno()],
                                   stdin=subprocess.DEVNULL, stdout=2, env=imports_env,
                                   cwd=pathlib.Path(__file__).parent.parent)
    server = _Server(process, ours)
    try:
        _answer(server, 300)  # imported
    except BaseException:
        _end(server)
        raise
    _servers[key] = server
    return server


def _end(server: _Server) -> None:
    """Ends a warm process: end-of-file on its requests; killed if it does not end at once."""
    server.channel.close()
    try:
        server.process.wait(timeout=5)
    except subprocess.TimeoutExpired:
        server.process.kill()
        server.process.wait()


def _answer(server: _Server, timeout: float) -> dict:
    """The warm process's next answer; `TimeoutExpired` if none within `timeout` seconds."""
    server.channel.settimeout(timeout)
    try:
        answer = server.channel.recv(1 << 16)
    except TimeoutError:
        raise subprocess.TimeoutExpired(server.process.args, timeout) from None
    if not answer:
        raise RuntimeError(f"The warm process of tests/warm_processes.py ended (exit {server.process.wait()}): "
                           "see its stderr above; JAXMON_TESTS_FRESH_PROCESSES=1 starts every run afresh.")
    return json.loads(answer)


# -- the warm process ------------------------------------------------------------------------------

def _serve(channel: socket.socket) -> None:
    """Imports `PRELOAD`, then for each request on `channel` forks the child that runs it
    and answers its pid, until `channel` ends."""
    import importlib

    before = dict(os.environ)
    for name in PRELOAD:
        importlib.import_module(name)
    # What the imports set in the environment (JAX's default log level, say), as their setdefaults
    # would have in a fresh process: each child sets them the same way after taking the request's.
    added = {name: value for name, value in os.environ.items() if name not in before}
    channel.send(json.dumps({"ready": True}).encode())
    while True:
        message, streams, _, _ = socket.recv_fds(channel, 1 << 20, 3)
        if not message:
            return
        request = json.loads(message)
        request["env"] = {**added, **request["env"]}
        channel.send(json.dumps({"pid": _fork_orphan(request, streams)}).encode())
        for fd in streams:
            os.close(fd)


def _fork_orphan(request: dict, streams: list[int]) -> int:
    """The pid of a child that runs `request`, forked by a child of this process that then
    ends: orphaned, it is adopted by the requester (its nearest ancestor that adopts)."""
    read, write = os.pipe()
    parent = os.fork()
    if parent == 0:
        try:
            forker = os.getpid()
            child = os.fork()
            if child == 0:
                _child(request, streams, forker)  # never returns
            os.write(write, str(child).encode())
        finally:
            os._exit(0)
    os.close(write)
    child = os.read(read, 32)
    os.close(read)
    os.waitpid(parent, 0)
    return int(child)


def _child(request: dict, streams: list[int], forker: int) -> None:
    """Becomes `python ARGS` (`-m jaxmon ...` or `SCRIPT.py ...`) in `cwd` with `env` on
    `streams`, once adopted by the requester (its parent, `forker`, ends at once)."""
    code = 1
    try:
        while os.getppid() == forker:  # a millisecond
            time.sleep(0.001)
        if os.getppid() != request["requester"]:  # no one would wait for it: said, not run
            os.write(streams[2], b"tests/warm_processes.py: the child was not adopted by the test's process\n")
            return
        for fd, stream in enumerate(streams):
            os.dup2(stream, fd)
        os.closerange(3, 1 << 16)  # as subprocess's close_fds: the requests, the streams as received
        if request["new_session"]:
            os.setsid()
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        if "tempfile" in sys.modules:  # its directory found again, from this environment's TMPDIR
            sys.modules["tempfile"].tempdir = None
        _fresh_std_streams()
        import numpy as np

        np.random.seed()  # from the OS's entropy, as NumPy's import seeds it in a fresh process
        try:
            _run_main(request["args"])
            code = 0
        except SystemExit as ended:  # as the interpreter ends on `sys.exit(code)`
            code = _exit_code(ended.code)
        except KeyboardInterrupt:  # an uncaught Ctrl-C ends the process by SIGINT, as Python's own
            sys.excepthook(*sys.exc_info())
            _python_exit()
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
        except BaseException:
            sys.excepthook(*sys.exc_info())
        _python_exit()
    except BaseException:  # before the run: the working directory, the streams
        import traceback

        traceback.print_exc()
    finally:
        os._exit(code)


def _run_main(args: list[str]) -> None:
    """Runs what `python ARGS` runs as its main module, as the interpreter starts it: a
    fresh __main__, `sys.argv` and `sys.orig_argv`, and first on the path the working
    directory (-m) or the script's own."""
    import runpy
    import types

    main = sys.modules["__main__"] = types.ModuleType("__main__")
    sys.orig_argv = [sys.executable, *args]
    if args[0] == "-m":
        sys.argv, sys.path = ["-m", *args[2:]], _path(os.getcwd())  # argv[0] is "-m" while the module is found
        runpy._run_module_as_main(args[1])  # what the interpreter calls for -m
        return
    script = args[0]
    sys.argv, sys.path = list(args), _path(os.path.dirname(os.path.realpath(script)))
    main.__file__, main.__cached__ = script, None
    with open(script, "rb") as source:
        code = compile(source.read(), script, "exec", dont_inherit=True)  # not this file's __future__
    exec(code, main.__dict__)


def _path(first: str) -> list[str]:
    """`sys.path` as the interpreter starts it in this environment: `first`, PYTHONPATH's
    directories, then the rest of the warm process's path (the standard library, the
    site-packages)."""
    return [first, *_python_path(os.environ), *_INSTALLED]


def _python_path(env: typing.Mapping[str, str]) -> list[str]:
    return [os.path.abspath(entry) for entry in env.get("PYTHONPATH", "").split(os.pathsep) if entry]


#: The warm process's path after its first entry and its PYTHONPATH's.
_INSTALLED = [entry for entry in sys.path[1:] if entry not in _python_path(os.environ)]


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
                                        write_through=not buffered, newline="\n"))
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
    _serve(socket.socket(fileno=int(sys.argv[1])))
