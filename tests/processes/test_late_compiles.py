"""A process that compiles long after another does not fail the run.

Real hosts differ in compile times: one finds its programs in the persistent cache (on
the CPU only process 0 writes it, and its keys hold the process's topology), another
compiles from scratch, or is loaded. A program's first collective over a group of
devices makes a new communicator, and gloo gives a late peer 30 s for that: a run whose
process 1 compiled its first step 40 s after process 0 ended with a false `PeerError`.
Now every process waits for the others to have compiled the session's first program
before running it (a barrier of JAX's coordination service).

`jaxmon train --processes 2` (two CPU devices each) on `helpers.tiny_config`, whose
`LateCompiles` hook makes process 1's first compile of the named programs 35 s late.
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
from helpers import ROOT, cpu_env, tiny_config

import jaxmon as jm

LATE = "35"  # past gloo's 30 s
STEPS = 60
SESSION = '"steps_per_dispatch": 2, "scan_unroll": 1'  # runs of two steps, a program per run length
RESULT = re.compile(r"step (\d+): test accuracy ([\d.]+), loss ([\d.]+)  \((.+)\)")
WAITED = re.compile(r"Waited (\d+\.\d) s for the other processes to compile the step\.")


def _launch(config: Path, workdir: Path, **env: str) -> subprocess.Popen:
    """`jaxmon train --processes 2` with the workdir's compilation cache (not the suite's)."""
    env = {name: value for name, value in {**cpu_env(2), **env}.items() if name != "JAX_COMPILATION_CACHE_DIR"}
    return subprocess.Popen([sys.executable, "-m", "jaxmon", "train", "--config", str(config), "--workdir",
                             str(workdir), "--processes", "2"], cwd=ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _finish(launcher: subprocess.Popen, timeout: float = 420) -> tuple[str, str]:
    """The launcher's output once it ends (killed, with its children, if it outlives `timeout`)."""
    try:
        return launcher.communicate(timeout=timeout)
    finally:
        if launcher.poll() is None:
            for pid in _children(launcher).values():
                os.kill(pid, signal.SIGKILL)
            launcher.kill()
            launcher.wait(timeout=30)


def _children(launcher: subprocess.Popen) -> dict[int, int]:
    """The launcher's JAX processes: {JAX_PROCESS_ID: pid}."""
    try:
        pids = Path(f"/proc/{launcher.pid}/task/{launcher.pid}/children").read_text().split()
    except OSError:
        return {}
    found = {}
    for pid in map(int, pids):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        ids = [item.split(b"=", 1)[1] for item in env if item.startswith(b"JAX_PROCESS_ID=")]
        if ids:
            found[int(ids[0])] = pid
    return found


def _params(workdir: Path) -> list[np.ndarray]:
    return [np.asarray(leaf) for leaf in jax.tree.leaves(jm.restore_checkpoint(workdir).state)]


@pytest.fixture(scope="module")
def late_run(tmp_path_factory):
    """A run to step 60 whose process 1 compiles the first step's program, the first
    evaluation's and the program of the first run of two steps 35 s late: (its workdir,
    the launcher's exit code, stdout, stderr)."""
    directory = tmp_path_factory.mktemp("late")
    launcher = _launch(tiny_config(directory, steps=STEPS, late_compiles=True, session=SESSION), directory / "run",
                       LATE_COMPILE_SECS=LATE, LATE_COMPILES="jit_variant:2,jit__traced:1")
    out, err = _finish(launcher)
    return directory / "run", launcher.returncode, out, err


@pytest.mark.processes
@pytest.mark.slow
def test_process_1_35_s_late_at_its_first_step_evaluation_and_run_length_still_trains_to_the_end(late_run):
    """The first step's program, the first evaluation's and the program of the first run of
    two steps (one program per run length, the accelerators' choice): each compiled 35 s
    after process 0 has it."""
    workdir, code, out, err = late_run
    assert code == 0, err[-3000:]
    assert RESULT.search(out)[1] == "60", out[-2000:]
    log = (workdir / "process-1.log").read_text()
    assert log.count(f"LateCompiles: jit_variant {LATE} s late") == 2, log[-3000:]
    assert log.count(f"LateCompiles: jit__traced {LATE} s late") == 1, log[-3000:]
    assert float(WAITED.search(out + err)[1]) >= 30, out + err  # process 0 waited for the first step's compile
    assert jm.latest_checkpoint_step(workdir) == 60


@pytest.mark.processes
@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="finds the child process in /proc")
def test_a_rerun_after_a_sigkill_resumes_exactly_though_only_process_0_finds_its_programs_in_the_cache(tmp_path,
                                                                                                       late_run):
    """The trial's false PeerError: process 1 SIGKILLed after checkpoint 20, then the same
    command again, with the workdir's compilation cache on: process 0 finds its step in
    the cache, process 1 compiles it (35 s late). The rerun ends as the uninterrupted run
    of `late_run` did (late compiles change no number)."""
    reference, code, out, err = late_run
    assert code == 0 and RESULT.search(out)[1] == "60", err[-3000:]

    workdir = tmp_path / "run"
    config = tiny_config(tmp_path, steps=STEPS, sleep=0.2, late_compiles=True, session=SESSION)  # 0.1 s a step
    launcher = _launch(config, workdir)
    try:
        deadline = time.monotonic() + 240
        while (jm.latest_checkpoint_step(workdir) or 0) < 20:
            assert launcher.poll() is None, launcher.communicate()
            assert time.monotonic() < deadline, f"no checkpoint 20 in {workdir}"
            time.sleep(0.1)
        os.kill(_children(launcher)[1], signal.SIGKILL)
    finally:
        out, err = _finish(launcher, timeout=60)
    assert launcher.returncode == 128 + signal.SIGKILL, err[-3000:]
    saved = jm.latest_checkpoint_step(workdir)
    assert 20 <= saved < STEPS
    assert any((workdir / "compilation_cache").iterdir())  # process 0 wrote its programs there

    rerun = _launch(config, workdir, LATE_COMPILE_SECS=LATE, LATE_COMPILES="jit_variant:1")
    out, err = _finish(rerun)
    assert rerun.returncode == 0, err[-3000:]
    assert f"Resumed from step {saved} in {workdir}; training on to step {STEPS}." in out, out[-2000:]
    assert float(WAITED.search(out + err)[1]) >= 30, out + err  # process 0 had its step from the cache
    assert f"LateCompiles: jit_variant {LATE} s late" in (workdir / "process-1.log").read_text()
    for got, want in zip(_params(workdir), _params(reference), strict=True):
        np.testing.assert_array_equal(got, want)
