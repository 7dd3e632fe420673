"""`jm.distributed` in one process: the variables it reads, `initialize`'s arguments to
`jax.distributed.initialize` (a recording fake: no other process), a failed connection
told as a `ConnectionError`, `shutdown` after a lost peer, and the last line and exit
code of a process whose peer died (in a child process). Several real processes:
tests/processes/ and tests/end_to_end/test_multiprocess.py."""

import contextlib
import logging
import subprocess
import sys

import jax
import pytest
from helpers import ROOT, cpu_env

import jaxmon as jm
from jaxmon import distributed
from jaxmon._processes import agree


@pytest.fixture
def environment(monkeypatch):
    """No JAX variable set (the test sets its own)."""
    for name in (*distributed.VARIABLES, distributed.KUBERNETES_INDEX):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


@pytest.fixture
def calls(environment):
    """`jax.distributed.initialize` and `shutdown` replaced by recorders, and no C++
    terminate handler installed in this process; returns the calls."""
    made = []
    environment.setattr(distributed, "_clean_fatal_errors",
                        lambda timeout: contextlib.nullcontext(made.append(("clean_fatal_errors", timeout))))
    environment.setattr(jax.distributed, "initialize", lambda *args, **kwargs: made.append(("initialize", args,
                                                                                              kwargs)))
    environment.setattr(jax.distributed, "shutdown", lambda: made.append(("shutdown",)))
    environment.setitem(agree.failure_line, "where", "")
    return made


def test_the_variables_set_are_read_stripped(environment):
    assert distributed.variables() == {}
    environment.setenv("JAX_COORDINATOR_ADDRESS", " 10.0.0.1:1234 ")
    environment.setenv("JAX_NUM_PROCESSES", "4")
    environment.setenv("JAX_PROCESS_ID", "  ")  # blank: not set
    environment.setenv("JOB_COMPLETION_INDEX", "2")
    assert distributed.variables() == {"JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234", "JAX_NUM_PROCESSES": "4",
                                       "JAX_PROCESS_ID": "2"}  # a Kubernetes indexed Job's pod index
    environment.setenv("JAX_PROCESS_ID", "1")
    assert distributed.variables()["JAX_PROCESS_ID"] == "1"
    environment.delenv("JAX_NUM_PROCESSES")
    environment.delenv("JAX_PROCESS_ID")
    assert "JAX_PROCESS_ID" not in distributed.variables()  # the index alone says nothing


def test_initialize_passes_the_environments_values_and_a_heartbeat_timeout(calls, environment):
    environment.setenv("JAX_COORDINATOR_ADDRESS", "10.0.0.1:1234")
    environment.setenv("JAX_NUM_PROCESSES", "4")
    environment.setenv("JAX_PROCESS_ID", "3")
    distributed.initialize(preemption_sync=False, log_prefix=False)
    distributed.initialize("other:1", num_processes=2, process_id=0, initialization_timeout=5,
                           preemption_sync=False, log_prefix=False, heartbeat_timeout_seconds=7, local_device_ids=[0])
    assert calls == [
        ("clean_fatal_errors", 300),
        ("initialize", ("10.0.0.1:1234",), {"num_processes": 4, "process_id": 3, "initialization_timeout": 300,
                                            "heartbeat_timeout_seconds": distributed.HEARTBEAT_TIMEOUT_SECS}),
        ("clean_fatal_errors", 5),
        ("initialize", ("other:1",), {"num_processes": 2, "process_id": 0, "initialization_timeout": 5,
                                      "heartbeat_timeout_seconds": 7, "local_device_ids": [0]})]
    assert agree.failure_line["where"].startswith("process 0 of 1, coordinator ")


def test_a_log_prefix_names_the_process_on_each_jaxmon_line(calls, caplog):
    before = list(distributed.logger.filters)
    try:
        with caplog.at_level(logging.INFO, logger="jaxmon"):
            distributed.initialize("here:1", 1, 0, preemption_sync=False)
            distributed.logger.info("hello")
        assert [r.getMessage() for r in caplog.records] == [
            f"[process 0/1] Process 0 of 1, {jax.local_device_count()} local of {jax.device_count()} devices.",
            "[process 0/1] hello"]
    finally:
        distributed.logger.filters[:] = before


def test_a_process_that_cannot_connect_gets_a_connection_error_saying_what_to_check(calls, environment):
    def never(*args, **kwargs):
        raise RuntimeError("DEADLINE_EXCEEDED: Barrier timed out.\n  Waited 5 s")

    environment.setattr(jax.distributed, "initialize", never)
    with pytest.raises(ConnectionError) as error:
        distributed.initialize("10.0.0.1:1234", 4, 2, initialization_timeout=5, preemption_sync=False,
                               log_prefix=False)
    assert str(error.value).startswith("JAX process 2 of 4 could not connect to the others (coordinator "
                                       "10.0.0.1:1234) within initialization_timeout=5 s:")
    assert "its own JAX_PROCESS_ID (0 to 3)" in str(error.value)
    assert str(error.value).endswith("(RuntimeError: DEADLINE_EXCEEDED: Barrier timed out. Waited 5 s)")
    assert calls == [("clean_fatal_errors", 5), ("shutdown",)]  # what JAX set up is taken down

    def broken(*args, **kwargs):
        raise ValueError("a bad argument")

    environment.setattr(jax.distributed, "initialize", broken)
    with pytest.raises(ValueError, match="a bad argument"):  # any other error: as it is
        distributed.initialize("x:1", 2, 0, preemption_sync=False, log_prefix=False)


def test_shutdown_skips_the_barrier_after_a_lost_peer(calls, environment, caplog):
    environment.setattr(agree, "peer_lost", lambda: False)
    distributed.shutdown()
    environment.setattr(agree, "peer_lost", lambda: True)
    with caplog.at_level(logging.INFO, logger="jaxmon"):
        distributed.shutdown()
    assert calls == [("shutdown",)]
    assert "Not shutting down jax.distributed: a peer was lost" in caplog.text


def test_the_chief_is_process_0():
    assert jm.distributed.is_chief() is (jax.process_index() == 0) is True


def test_a_failed_coordination_ends_the_process_with_one_line_and_exit_code_75():
    program = ("from jaxmon import distributed\n"
               "distributed._agree.failure_line['where'] = 'process 1 of 2, coordinator here:1'\n"
               "distributed._coordination_failed('UNAVAILABLE: Connection reset\\n by peer')\n"
               "print('not reached')\n")
    result = subprocess.run([sys.executable, "-c", program], cwd=ROOT, env=cpu_env(), capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == distributed.PEER_LOST_EXIT_CODE == 75
    assert result.stdout == ""
    assert result.stderr == (
        "jaxmon: PeerError: JAX's coordination service reports a failure: another process of this run died or "
        "stopped answering, or the coordinator (process 0) did (UNAVAILABLE: Connection reset by peer). This "
        "process (process 1 of 2, coordinator here:1) stops too, with exit code 75; the complete checkpoints "
        "stand: start every process again to resume.\n")
