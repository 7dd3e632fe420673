"""`jaxmon train` started the way a cluster starts it, with no `--processes`, on
127.0.0.1: two tasks of a SLURM job step (`srun -n 2 jaxmon train ...`), each given only
the variables SLURM sets (JAX's own detection), and two pods of a Kubernetes indexed Job
(the manifest's coordinator and process count, the pod's `JOB_COMPLETION_INDEX`); they
connect, train, and resume."""

import os
import re
import socket
import subprocess
import sys

import pytest
import warm_processes
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
    return started(config, workdir, [{"SLURM_JOB_ID": str(job), "SLURM_STEP_NODELIST": "127.0.0.1",
                                      "SLURM_NTASKS": "2", "SLURM_PROCID": str(task), "SLURM_LOCALID": str(task),
                                      "SLURM_STEP_NUM_NODES": "1"} for task in range(2)])


def indexed_job(config, workdir) -> list[subprocess.CompletedProcess]:
    """Two pods of a Kubernetes indexed Job: the manifest's variables and the pod's index."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    return started(config, workdir, [{"JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}", "JAX_NUM_PROCESSES": "2",
                                      "JOB_COMPLETION_INDEX": str(pod)} for pod in range(2)])


def started(config, workdir, variables: list[dict]) -> list[subprocess.CompletedProcess]:
    """`jaxmon train` once per entry of `variables` (its environment's additions), all at once."""
    tasks = []
    for added in variables:
        env = {**cpu_env(2), **added}
        for name in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
            if name not in added:
                env.pop(name, None)
        tasks.append(warm_processes.popen([sys.executable, "-m", "jaxmon", "train", "--config", str(config),
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
@pytest.mark.parametrize("cluster", ["slurm", "kubernetes"])
def test_two_tasks_of_a_cluster_train_as_one_run_and_resume(tmp_path, cluster):
    def start(steps):
        config = tiny_config(tmp_path, steps=steps)
        return srun(config, workdir, slurm_job_id()) if cluster == "slurm" else indexed_job(config, workdir)

    workdir = tmp_path / "run"
    first = start(20)
    for task, done in enumerate(first):
        assert done.returncode == 0, (task, done.stderr[-3000:])
        assert RESULT.search(done.stdout)[1] == "20", done.stdout
    assert "[process 1/2] Process 1 of 2, 2 local of 4 devices." in first[1].stderr
    assert jm.latest_checkpoint_step(workdir) == 20
    again = start(30)
    for task, done in enumerate(again):
        assert done.returncode == 0, (task, done.stderr[-3000:])
        assert RESULT.search(done.stdout)[1] == "30", done.stdout
        assert f"[process {task}/2] Restored step 20 from" in done.stderr, done.stderr[-3000:]
    assert jm.latest_checkpoint_step(workdir) == 30
