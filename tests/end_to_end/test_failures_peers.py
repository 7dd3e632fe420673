"""A dying peer: two `jaxmon train` processes on 127.0.0.1, one SIGKILLed mid-run, or
process 1 stopped (SIGSTOP: hung, its connections open), which the heartbeat timeout
catches.

The survivor must end within 30 s with exit code 75 (`PeerError.exit_code` for a lost
peer) and one clear last line naming the peer failure, without a native dump, whether
the dead one is process 1 (the survivor's collective fails: `PeerError` in its main
thread) or the coordinator, process 0 (JAX's coordination client notices on its own
thread, where jaxmon replaces JAX's fatal log with the line). Started again, both
processes end at the uninterrupted run's final state, bit for bit.

The fast tests check the pieces without processes: the exit codes and the CLI's help.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
import warm_processes
from helpers import ROOT, cpu_env, free_port, tiny_config

import jaxmon as jm
from jaxmon._processes import agree as _agree

STEPS = 80
NATIVE = ("Check failure", "*** ", "terminate called", "Traceback", "Fatal Python error")
FATAL_LOG = re.compile(r"^[EF]\d{4} ", re.MULTILINE)  # absl's error and fatal lines: E1126 01:07:17.173388 ...


# -- fast -----------------------------------------------------------------------------------------


def test_a_lost_peer_exits_75_and_a_peers_error_exits_1():
    assert _agree.PEER_LOST_EXIT_CODE == 75
    assert jm.PeerError("gone", lost=True).exit_code == 75
    assert jm.PeerError("JAX process 1 failed after step 3: NaN", step=3).exit_code == 1


def test_train_help_documents_exit_75():
    result = subprocess.run([sys.executable, "-m", "jaxmon", "train", "--help"], cwd=ROOT, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    text = " ".join(result.stdout.split())
    assert "75 another process of the run died or stopped answering" in text, text


NOISY_THREAD = """
import importlib.util, os, sys, threading, time

spec = importlib.util.spec_from_file_location("_signals", "jaxmon/_base/signals.py")  # no JAX to start
_signals = importlib.util.module_from_spec(spec)
spec.loader.exec_module(_signals)

def noise():  # native log lines from other threads, as JAX's coordination client writes one
    while True:
        os.write(2, b"E0000 noise from another thread\\n")
        time.sleep(0.0005)  # not so many that the pipe fills: a writer blocked on a full pipe lands later

for _ in range(2):
    threading.Thread(target=noise, daemon=True).start()
time.sleep(0.05)
_signals.write_last_line("jaxmon train: PeerError: the last line\\n")
print("nothing after it", file=sys.stderr, flush=True)
os._exit(75)
"""


def test_the_last_line_stays_last_while_other_threads_write_to_stderr():
    for _ in range(5):  # the threads write between the line and the exit on most tries, unless silenced
        done = subprocess.run([sys.executable, "-c", NOISY_THREAD], cwd=ROOT, capture_output=True, text=True,
                              timeout=60)
        assert done.returncode == 75, done.stderr[-2000:]
        lines = done.stderr.splitlines()
        assert lines[-1] == "jaxmon train: PeerError: the last line", lines[-3:]
        assert "nothing after it" not in done.stderr


BOTH_END_IT = """
import os, threading, time
from jaxmon import distributed
from jaxmon._base import signals as _signals
from jaxmon._processes import agree

real_sleep = time.sleep

def sleep(secs):  # JAX's client thread, starved under load, wakes long after its 50 ms
    real_sleep(secs * 20 if threading.current_thread().name == "client" else secs)

time.sleep = sleep
threading.Thread(target=distributed._coordination_failed, name="client", daemon=True).start()
while os.path.realpath("/proc/self/fd/2") != os.devnull:  # the client is writing its line
    real_sleep(0.001)
try:  # meanwhile the main thread's collective fails, and it ends the process as `jaxmon train` does
    raise agree._peer_lost("A collective of step 21 failed: another JAX process stopped answering.")
except agree.PeerError as error:
    _signals.write_last_line(f"jaxmon train: PeerError: {error}\\n")
    os._exit(error.exit_code)
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/fd/2"), reason="reads where stderr points in /proc")
def test_a_survivor_that_both_of_its_threads_end_says_one_line():
    """The coordinator died: JAX's client (its own thread) and the main thread's failed
    collective each end the survivor with a line. The one that starts first says it; a
    second one that wrote too would find stderr pointed at the null device already, and
    ending the process first, leave it with no line at all."""
    done = subprocess.run([sys.executable, "-c", BOTH_END_IT], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env=cpu_env())
    assert done.returncode == 75, done.stderr[-2000:]
    lines = done.stderr.strip().splitlines()
    assert lines and lines[-1].startswith("jaxmon: PeerError: JAX's coordination service reports a failure"), lines
    assert sum("PeerError" in line for line in lines) == 1, lines

# -- two processes ----------------------------------------------------------------------------------


def _start(config: Path, workdir: Path, env: dict[str, str] | None = None,
           devices: int | None = None) -> list[subprocess.Popen]:
    """Both processes of one run (`devices` CPU devices each, else one), connected on a free
    port of 127.0.0.1; `env`: more variables."""
    env = {**cpu_env(devices), "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{free_port()}", "JAX_NUM_PROCESSES": "2",
           **(env or {})}
    return [warm_processes.popen([sys.executable, "-m", "jaxmon", "train", "--config", str(config), "--workdir",
                                  str(workdir), "--quiet"], cwd=ROOT, env={**env, "JAX_PROCESS_ID": str(i)},
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
            for i in range(2)]


def _kill_all(processes: list[subprocess.Popen]) -> None:
    """Kills what is left of a run's processes (a failed test leaves none behind)."""
    for process in processes:
        if process.poll() is None:
            process.kill()
        process.wait(timeout=30)


def _wait_for_checkpoint(workdir: Path, processes: list[subprocess.Popen], step: int) -> None:
    """Returns once checkpoint `step` (or a later one) is complete; fails if a process ended first."""
    deadline = time.monotonic() + 300
    while (latest := jm.latest_checkpoint_step(workdir)) is None or latest < step:
        assert all(p.poll() is None for p in processes), [p.communicate() for p in processes]
        assert time.monotonic() < deadline, f"no checkpoint {step} in {workdir}"
        time.sleep(0.1)


def _signal(victim: subprocess.Popen, signum: int, survivor: subprocess.Popen,
            timeout: float) -> tuple[str, str, float]:
    """Sends `signum` to `victim`; the survivor's output once it ends, and the seconds that took."""
    os.kill(victim.pid, signum)
    start = time.monotonic()
    out, err = survivor.communicate(timeout=timeout)
    return out, err, time.monotonic() - start


def _run_to_the_end(config: Path, workdir: Path) -> None:
    processes = _start(config, workdir)
    try:
        for i, process in enumerate(processes):
            out, err = process.communicate(timeout=400)
            assert process.returncode == 0, (i, err[-3000:])
    finally:
        _kill_all(processes)
    assert jm.latest_checkpoint_step(workdir) == STEPS


def _final_state(workdir: Path) -> dict:
    restored = jm.restore_checkpoint(workdir)
    assert restored.step == STEPS
    return jax.tree.map(np.asarray, restored.state)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The final state of the run nothing interrupted (two processes, to the end)."""
    directory = tmp_path_factory.mktemp("uninterrupted")
    config = tiny_config(directory, steps=STEPS, sleep=0.05)
    _run_to_the_end(config, directory / "run")
    return config, _final_state(directory / "run")


@pytest.mark.processes
@pytest.mark.slow
@pytest.mark.parametrize("victim", [1, 0], ids=["process-1-dies", "the-coordinator-dies"])
def test_a_killed_peer_ends_the_other_with_75_and_one_line_and_both_resume_exactly(tmp_path, uninterrupted,
                                                                                   victim):
    config, expected = uninterrupted
    workdir = tmp_path / "run"
    processes = _start(config, workdir)
    survivor = processes[1 - victim]
    try:
        _wait_for_checkpoint(workdir, processes, 20)  # mid-run: after the first saves
        out, err, seconds = _signal(processes[victim], signal.SIGKILL, survivor, timeout=30)
    finally:
        _kill_all(processes)
    print(f"SIGKILL of process {victim}: process {1 - victim} ended {seconds:.2f} s later, exit "
          f"{survivor.returncode}")
    assert survivor.returncode == _agree.PEER_LOST_EXIT_CODE, err[-3000:]
    lines = (out + err).strip().splitlines()
    assert err.strip(), f"no line on the survivor's stderr; its stdout: {out[-3000:]}"
    last = err.strip().splitlines()[-1]
    assert last.startswith("jaxmon train: PeerError: "), err[-3000:]
    assert "stopped answering" in last and "stops too" in last, last
    assert len(lines) < 15, "\n".join(lines)
    for word in NATIVE:
        assert word not in err, (word, err[-3000:])
    assert not FATAL_LOG.search(err), err[-3000:]
    saved = jm.latest_checkpoint_step(workdir)
    assert saved is not None and 20 <= saved < STEPS  # the complete checkpoints stand

    _run_to_the_end(config, workdir)  # the same command on both: they resume from `saved`
    resumed = _final_state(workdir)
    assert jax.tree.structure(resumed) == jax.tree.structure(expected)
    for got, want in zip(jax.tree.leaves(resumed), jax.tree.leaves(expected), strict=True):
        np.testing.assert_array_equal(got, want)


@pytest.mark.processes
@pytest.mark.slow
def test_a_hung_peer_ends_the_other_with_75_and_one_line_within_30_seconds(tmp_path):
    """Process 1 stopped (SIGSTOP: alive, answering nothing, its connections open): the
    coordinator's missed heartbeats end process 0, as its lost peer, with one line."""
    workdir = tmp_path / "run"
    processes = _start(tiny_config(tmp_path, steps=10_000, sleep=0.02), workdir)
    try:
        _wait_for_checkpoint(workdir, processes, 20)
        out, err, seconds = _signal(processes[1], signal.SIGSTOP, processes[0], timeout=40)
    finally:
        if processes[1].poll() is None:
            os.kill(processes[1].pid, signal.SIGCONT)
        _kill_all(processes)
    print(f"SIGSTOP of process 1: process 0 ended {seconds:.2f} s later, exit {processes[0].returncode}")
    assert processes[0].returncode == _agree.PEER_LOST_EXIT_CODE, err[-3000:]
    assert seconds < 30, seconds
    last = err.strip().splitlines()[-1]
    assert last.startswith("jaxmon train: PeerError: ") and "stopped answering" in last, err[-3000:]
    assert len((out + err).strip().splitlines()) < 15, out + err
    for word in NATIVE:
        assert word not in err, (word, err[-3000:])
    assert not FATAL_LOG.search(err), err[-3000:]


@pytest.mark.processes
@pytest.mark.slow
def test_a_peer_that_dies_while_the_other_waits_for_its_compile_ends_it_with_75_and_one_line(tmp_path):
    """Process 0 compiled its first step and waits for process 1 to have compiled it too
    (helpers.tiny_config's LateCompiles makes that 60 s); process 1 is SIGKILLed
    meanwhile: the coordination service reports it, and process 0 ends with 75."""
    workdir = tmp_path / "run"
    late = {"LATE_COMPILE_SECS": "60", "LATE_COMPILES": "jit_variant:1"}
    processes = _start(tiny_config(tmp_path, steps=40, late_compiles=True), workdir, env=late, devices=2)
    try:
        _wait_for_checkpoint(workdir, processes, 0)  # checkpoint 0 comes before the step compiles
        time.sleep(3)
        out, err, seconds = _signal(processes[1], signal.SIGKILL, processes[0], timeout=40)
    finally:
        _kill_all(processes)
    print(f"SIGKILL of process 1 during process 0's wait: process 0 ended {seconds:.2f} s later")
    assert processes[0].returncode == _agree.PEER_LOST_EXIT_CODE and seconds < 30, (seconds, err[-3000:])
    last = err.strip().splitlines()[-1]
    # The coordination service reports the dead peer to the barrier (the main thread) and to JAX's
    # client (its own thread) at once: whichever ends the process says so, each in its one line.
    assert last.startswith(("jaxmon train: PeerError: While this process waited for the others to have compiled "
                            "the step, one of them stopped answering",
                            "jaxmon train: PeerError: JAX's coordination service reports a failure: another process "
                            "of this run died or stopped answering")), err[-3000:]
    assert len((out + err).strip().splitlines()) < 15, out + err
    assert "Traceback" not in err and not FATAL_LOG.search(err), err[-3000:]
