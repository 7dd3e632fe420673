"""`jaxmon launch -n N -- COMMAND`: a user's own program in N connected processes, ended
as `jaxmon train --processes N` ends (one line, the failed process's exit code)."""

import subprocess
import sys

import pytest
from helpers import ROOT, cpu_env

SCRIPT = """\
import sys
import jax
import numpy as np
from jax.experimental import multihost_utils
import jaxmon as jm

jm.distributed.initialize()
total = int(multihost_utils.process_allgather(np.array([jax.process_index() + 1])).sum())
print(f"process {jax.process_index()} of {jax.process_count()}: {jax.device_count()} devices, sum {total}", flush=True)
if jax.process_index() == 1 and sys.argv[1:] == ["fail"]:
    sys.exit(3)
"""


def launch(tmp_path, *args, script_args=()):
    script = tmp_path / "mine.py"
    script.write_text(SCRIPT)
    return subprocess.run([sys.executable, "-m", "jaxmon", "launch", *args, "--", sys.executable, str(script),
                           *script_args], cwd=ROOT, env=cpu_env(2), capture_output=True, text=True, timeout=180)


@pytest.mark.processes
def test_a_script_runs_in_two_connected_processes_each_with_its_devices(tmp_path):
    done = launch(tmp_path, "-n", "2", "--log_dir", str(tmp_path / "logs"))
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    assert lines[0].startswith("Running in 2 processes on the CPU of this machine (coordinator 127.0.0.1:")
    assert "process 0 of 2: 4 devices, sum 3" in lines  # two processes of 2 CPU devices, connected
    assert "process 1 of 2: 4 devices, sum 3" in (tmp_path / "logs" / "process-1.log").read_text()


@pytest.mark.processes
def test_a_failing_process_stops_the_launch_with_its_code_and_one_line(tmp_path):
    done = launch(tmp_path, "-n", "2", "--log_dir", str(tmp_path), script_args=["fail"])
    assert done.returncode == 3, done.stderr[-3000:]
    assert done.stderr.strip().splitlines()[-1] == (
        f"jaxmon launch: process 1 of 2 exited with code 3 (its log is {tmp_path / 'process-1.log'}); the other "
        "processes were stopped.")


@pytest.mark.parametrize("args, words", [(["-n", "2"], "needs the program to run after --"),
                                         (["-n", "1", "--", "true"], "starts 2 or more processes"),
                                         (["-n", "two", "--", "true"], "-n='two': give a whole number")])
def test_a_launch_given_wrong_exits_2_with_one_line(args, words):
    done = subprocess.run([sys.executable, "-m", "jaxmon", "launch", *args], cwd=ROOT, env=cpu_env(),
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and done.stderr.startswith("jaxmon launch: ") and words in done.stderr, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1
