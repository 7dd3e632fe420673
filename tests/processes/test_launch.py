"""`jaxmon train` started the way a cluster starts it, with no `--processes`: two tasks of
a SLURM job step (`srun -n 2 jaxmon train ...`), each given only the variables SLURM
sets, on 127.0.0.1; they connect (JAX's own detection), train, and resume."""

import os
import re
import socket
import subprocess
import sys

import pytest
from helpers import ROOT, cpu_env, tiny_config

import jaxmon as jm

RESULT = re.compile(r"step (\d+): test accuracy")


def slurm_job_id() -> int:
    """A job id whose coordinator port (JAX: the job id mod 4096, from 61440) is free now."""
    for job in range(os.getpid() % 4096, os.getpid() % 4096 + 4096):
        port = job % 4096 + 61440
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
        return job
    raise RuntimeError("no free port from 61440 up")


def srun(config, workdir, job: int) -> list[subprocess.CompletedProcess]:
    """`srun -n 2 jaxmon train ...` on this machine: two tasks, SLURM's variables only."""
    tasks = []
    for task in range(2):
        env = {**cpu_env(2), "SLURM_JOB_ID": str(job), "SLURM_STEP_NODELIST": "127.0.0.1", "SLURM_NTASKS": "2",
               "SLURM_PROCID": str(task), "SLURM_LOCALID": str(task), "SLURM_STEP_NUM_NODES": "1"}
        for name in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
            env.pop(name, None)
        tasks.append(subprocess.Popen([sys.executable, "-m", "jaxmon", "train", "--config", str(config),
                                       "--workdir", str(workdir)], cwd=ROOT, env=env, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    done = []
    try:
        for task in tasks:
            out, err = task.communicate(timeout=240)
            done.append(subprocess.CompletedProcess(task.args, task.returncode, out, err))
    finally:
        for task in tasks:
            task.kill()
    return done


@pytest.mark.processes
@pytest.mark.slow
def test_two_slurm_tasks_train_as_one_run_and_resume(tmp_path):
    workdir, job = tmp_path / "run", slurm_job_id()
    first = srun(tiny_config(tmp_path, steps=20), workdir, job)
    for task, done in enumerate(first):
        assert done.returncode == 0, (task, done.stderr[-3000:])
        assert RESULT.search(done.stdout)[1] == "20", done.stdout
    assert "[process 1/2] Process 1 of 2, 2 local of 4 devices." in first[1].stderr
    assert jm.latest_checkpoint_step(workdir) == 20
    again = srun(tiny_config(tmp_path, steps=30), workdir, slurm_job_id())
    for task, done in enumerate(again):
        assert done.returncode == 0, (task, done.stderr[-3000:])
        assert RESULT.search(done.stdout)[1] == "30", done.stdout
        assert f"[process {task}/2] Restored step 20 from" in done.stderr, done.stderr[-3000:]
    assert jm.latest_checkpoint_step(workdir) == 30
