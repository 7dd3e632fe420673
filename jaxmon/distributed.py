"""Several JAX processes (one per host, or several on one machine) running one training.

jaxmon runs on JAX's own multi-controller runtime: every process runs the same
program, `jax.distributed` connects them, and a session with several processes agrees
on every decision that ends or changes the loop (see `MonitoredSession`).

Example (two processes on one machine; run the script twice, with `JAX_PROCESS_ID=0`
and `=1`)::

    import jaxmon as jm
    jm.distributed.initialize("127.0.0.1:12345", num_processes=2)   # or from the environment
    mesh = jax.make_mesh((jax.device_count(),), ("data",),         # every process's devices
                         axis_types=(jax.sharding.AxisType.Auto,))
    with jm.MonitoredTrainingSession(step_fn, init_fn, data=local_batches, mesh=mesh,
                                     checkpoint_dir="runs/dp") as sess:
        while not sess.should_stop():
            sess.run()

When a process dies, the others stop too, as JAX's multi-controller runtime wants, but
without native dumps: a survivor raises `jm.PeerError` (`lost=True`) at its next step's
collective (at once on CPU, where gloo reports the closed connection) or agreement, and
at exit it skips JAX's shutdown barrier, which would wait for the dead process, and ends
with exit code 75 (`PEER_LOST_EXIT_CODE`). Where the survivor does not notice by itself
(the coordinator, process 0, died: JAX's coordination client notices within
milliseconds; a peer that hangs: the heartbeat timeout, `heartbeat_timeout_seconds`,
`HEARTBEAT_TIMEOUT_SECS` here where JAX's is 100 s), JAX's client ends the process:
its default, a fatal log with a native stack trace, is replaced by one line on stderr
and exit code 75 (after up to `GRACE_SECS` for a main thread that already raised
`PeerError` to end the process itself).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import logging
import os
import re
import sys
import time
from collections.abc import Iterator
from typing import Any

import jax

from jaxmon._base import signals as _signals
from jaxmon._processes import agree as _agree

__all__ = ["PEER_LOST_EXIT_CODE", "initialize", "is_chief", "shutdown"]

logger = logging.getLogger("jaxmon")

#: What a process exits with when another process of the run died or stopped answering.
PEER_LOST_EXIT_CODE = _agree.PEER_LOST_EXIT_CODE

#: Seconds JAX's coordination client, once it reports a failure, leaves a main thread that
#: has raised `PeerError` already to end the process its own way (and the other way round).
GRACE_SECS = _agree.END_GRACE_SECS

#: The attribute of `jax._src.distributed` that makes JAX's coordination client (jaxlib's module).
_CLIENT_MODULE = "_jax"
_terminate: list[Any] = []  # the C++ terminate handler installed (kept alive), and the one it replaced
#: Seconds a process may stop answering (hung, or stopped) before the coordinator declares it
#: dead and the others stop: JAX's 100 s left a survivor waiting over a minute. Heartbeats
#: come from a thread of their own, so a long compile or save does not miss them.
HEARTBEAT_TIMEOUT_SECS = 20


#: How `jax.distributed.initialize` fails when a process never came within the timeout (jaxlib 0.10
#: gives the status to the missed-heartbeat callback, which throws std::bad_cast; see `_clean_fatal_errors`).
_NOT_CONNECTED = re.compile(r"DEADLINE_EXCEEDED|UNAVAILABLE|bad_cast")

#: The variables `jax.distributed.initialize()` reads.
VARIABLES = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")
#: A Kubernetes indexed Job's pod index: the process id where JAX_NUM_PROCESSES is set and JAX_PROCESS_ID is not.
KUBERNETES_INDEX = "JOB_COMPLETION_INDEX"


def variables() -> dict[str, str]:
    """The `VARIABLES` set in this process's environment (stripped); a Kubernetes indexed
    Job's pod index stands for `JAX_PROCESS_ID` where `JAX_NUM_PROCESSES` is set and it
    is not."""
    given = {name: os.environ[name].strip() for name in VARIABLES if os.environ.get(name, "").strip()}
    index = os.environ.get(KUBERNETES_INDEX, "").strip()
    if "JAX_NUM_PROCESSES" in given and "JAX_PROCESS_ID" not in given and index:
        given["JAX_PROCESS_ID"] = index
    return given


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, *, initialization_timeout: int = 300,
               preemption_sync: bool = True, log_prefix: bool = True, **kwargs) -> None:
    """`jax.distributed.initialize` with what a jaxmon session expects.

    Args:
      coordinator_address: `host:port` of process 0; default `$JAX_COORDINATOR_ADDRESS`
        (or what JAX detects on SLURM, Kubernetes, TPU pods, ...).
      num_processes: default `$JAX_NUM_PROCESSES`.
      process_id: this process's index; default `$JAX_PROCESS_ID`, else a Kubernetes indexed
        Job's `$JOB_COMPLETION_INDEX` (with `$JAX_NUM_PROCESSES` set).
      initialization_timeout: seconds to wait for every process to connect.
      preemption_sync: turn on JAX's preemption service, so that SIGTERM on any process
        makes every process save and stop at one agreed step.
      log_prefix: prefix the `jaxmon` logger's lines with `[process i/n]`.
      **kwargs: passed on to `jax.distributed.initialize` (e.g. `local_device_ids`, or
        `heartbeat_timeout_seconds`: how long a process may stop answering before the
        coordinator declares it dead and the others stop, `HEARTBEAT_TIMEOUT_SECS` by
        default; a process that dies with its connections closed is noticed at once).
    """
    given = variables()
    coordinator_address = coordinator_address or given.get("JAX_COORDINATOR_ADDRESS")
    if num_processes is None and "JAX_NUM_PROCESSES" in given:
        num_processes = int(given["JAX_NUM_PROCESSES"])
    if process_id is None and "JAX_PROCESS_ID" in given:
        process_id = int(given["JAX_PROCESS_ID"])
    if preemption_sync:
        jax.config.update("jax_enable_preemption_service", True)
    kwargs.setdefault("heartbeat_timeout_seconds", HEARTBEAT_TIMEOUT_SECS)
    try:
        with _clean_fatal_errors(initialization_timeout):
            jax.distributed.initialize(coordinator_address, num_processes=num_processes, process_id=process_id,
                                       initialization_timeout=initialization_timeout, **kwargs)
    except Exception as error:
        if not _NOT_CONNECTED.search(str(error)):
            raise
        with contextlib.suppress(Exception):  # what JAX set up would fail again at exit, with a traceback
            jax.distributed.shutdown()
        raise ConnectionError(
            f"JAX process {process_id} of {num_processes} could not connect to the others (coordinator "
            f"{coordinator_address}) within initialization_timeout={initialization_timeout} s: start every process "
            f"with the same JAX_COORDINATOR_ADDRESS and JAX_NUM_PROCESSES and its own JAX_PROCESS_ID (0 to "
            f"{(num_processes or 1) - 1}), or give a longer initialization_timeout. ({type(error).__name__}: "
            f"{' '.join(str(error).split())[:200]})") from error
    from jax._src.distributed import global_state

    _agree.failure_line["where"] = (f"process {jax.process_index()} of {jax.process_count()}, coordinator "
                      f"{global_state.coordinator_address}")
    if log_prefix:
        prefix = f"[process {jax.process_index()}/{jax.process_count()}] "

        def add_prefix(record: logging.LogRecord) -> bool:
            if not str(record.msg).startswith(prefix):
                record.msg = prefix + str(record.msg)
            return True

        logger.addFilter(add_prefix)
    logger.info("Process %d of %d, %d local of %d devices.", jax.process_index(), jax.process_count(),
                jax.local_device_count(), jax.device_count())


def is_chief() -> bool:
    """Whether this process is the chief (process 0): it writes summaries and runs
    `chief_only_hooks`."""
    return jax.process_index() == 0


def shutdown() -> None:
    """`jax.distributed.shutdown()`: disconnects from the other processes (after a lost
    peer it does nothing: JAX's shutdown barrier would wait for the dead process; the
    process then ends with exit code 75)."""
    if _agree.peer_lost():
        logger.info("Not shutting down jax.distributed: a peer was lost (its barrier would wait for it).")
        return
    jax.distributed.shutdown()


@contextlib.contextmanager
def _clean_fatal_errors(initialization_timeout: int) -> Iterator[None]:
    """While `jax.distributed.initialize` runs: the client it makes gets
    `_coordination_failed` as its missed-heartbeat callback, which JAX's coordination
    client calls (on its own thread) when the service reports an error, a peer's death
    included, or when the service is gone. Its default logs a fatal error with a
    native stack dump and aborts. The service (process 0's) waits for the others to
    register for `initialization_timeout`, as each process's client does (JAX leaves
    the service at an hour).

    jaxlib 0.10 cannot pass its `absl::Status` to a Python callback: the call throws
    std::bad_cast, which ends in std::terminate on the client's thread before the
    callback runs. So the callback goes in only where a C++ terminate handler that
    turns that bad_cast into `_coordination_failed` is in place (`_catch_terminate`);
    elsewhere JAX's default stays. A jaxlib that can call the callback calls it directly.
    """
    from jax._src import distributed as jax_distributed

    real = getattr(jax_distributed, _CLIENT_MODULE, None)
    make = getattr(real, "get_distributed_runtime_client", None)
    if make is None or "missed_heartbeat_callback" not in (make.__doc__ or "") or not _catch_terminate():
        yield
        return

    class WithCallback:
        def __getattr__(self, name: str) -> Any:
            return getattr(real, name)

        @staticmethod
        def get_distributed_runtime_client(*args: Any, **kwargs: Any) -> Any:
            kwargs.setdefault("missed_heartbeat_callback", _coordination_failed)
            return make(*args, **kwargs)

        @staticmethod
        def get_distributed_runtime_service(*args: Any, **kwargs: Any) -> Any:
            kwargs.setdefault("cluster_register_timeout", initialization_timeout)  # JAX leaves the service at 1 h
            return real.get_distributed_runtime_service(*args, **kwargs)

    setattr(jax_distributed, _CLIENT_MODULE, WithCallback())  # what its State.initialize calls
    try:
        yield
    finally:
        setattr(jax_distributed, _CLIENT_MODULE, real)


def _catch_terminate() -> bool:
    """Installs (once) a C++ terminate handler that calls `_coordination_failed` when
    the exception that ends the process is a std::bad_cast (what jaxlib's missed-heartbeat
    callback throws), and hands any other to the handler it replaced; returns whether
    it is in place (Linux with libstdc++ only)."""
    if _terminate:
        return True
    if not sys.platform.startswith("linux"):
        return False
    try:
        libstdcxx = ctypes.CDLL(ctypes.util.find_library("stdc++") or "libstdc++.so.6")
        set_terminate = libstdcxx["_ZSt13set_terminatePFvvE"]  # std::set_terminate
        exception_type = libstdcxx["__cxa_current_exception_type"]
    except (OSError, AttributeError):
        return False
    set_terminate.restype, set_terminate.argtypes = ctypes.c_void_p, [ctypes.c_void_p]
    exception_type.restype = ctypes.c_void_p
    handler_type = ctypes.CFUNCTYPE(None)

    def on_terminate() -> None:
        info = exception_type()  # a std::type_info: its vtable, then its mangled name
        name = ctypes.cast(info + ctypes.sizeof(ctypes.c_void_p), ctypes.POINTER(ctypes.c_char_p))[0] if info else None
        if name == b"St8bad_cast":
            _coordination_failed()
        handler_type(_terminate[1])()  # the previous handler: it prints the exception and aborts

    handler = handler_type(on_terminate)
    _terminate.extend([handler, set_terminate(ctypes.cast(handler, ctypes.c_void_p))])
    return True


def _coordination_failed(*status: Any) -> None:
    """What JAX's coordination client calls, on its own thread, when the service reports
    an error (another process died or stopped answering) or is gone (the coordinator
    died): one line on stderr, then exit code 75. A main thread that raised `PeerError`
    already is given `GRACE_SECS` to end the process itself first; one that raises it
    after this began waits for this to end the process (`_agree.claim_end`)."""
    if not _agree.claim_end("client"):
        time.sleep(GRACE_SECS)
    detail = f" ({' '.join(str(status[0]).split())[:300]})" if status else ""
    line = _agree.failure_line
    _signals.write_last_line(
        f"{line['prefix']}PeerError: JAX's coordination service reports a failure: another process of this run "
        f"died or stopped answering, or the coordinator (process 0) did{detail}. This process "
        f"({line['where'] or 'one of several'}) stops too, with exit code {_agree.PEER_LOST_EXIT_CODE}; "
        "the complete checkpoints stand: start every process again to resume.\n")
    os._exit(_agree.PEER_LOST_EXIT_CODE)
