"""A run resumed on another number of processes sees the global batches of the run
nothing interrupted: `jm.ArrayDataSource(shard="process")` and `jaxmon train`'s grain
pipeline keep one global position (global batches counted), and each process takes its
part of every global batch, whatever the number of processes.

`count_worker.py` trains to step 6 on one number of processes (one CPU device each,
started by `jaxmon launch`), then to step 12 on another, resuming from checkpoint 6; the
row ids of each process's batches, put together in process order, are each step's global
batch, compared with those of one process trained to step 12 in one go (the epoch, 5
batches, turns twice on the way). A source whose positions are its processes' own warns.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import warm_processes
from helpers import ROOT, cpu_env

WORKER = Path(__file__).with_name("count_worker.py")
LAST = 12


def _train(loader: str, directory: Path, processes: int, last_step: int, out: Path) -> str:
    """Runs the worker on `processes` processes to `last_step`; returns every process's output."""
    command = [sys.executable, str(WORKER), loader, str(directory / "run"), str(last_step), str(out)]
    if processes > 1:
        command = [sys.executable, "-m", "jaxmon", "launch", "-n", str(processes), "--log_dir", str(directory),
                   "--", *command]
    done = warm_processes.run(command, cwd=ROOT, env=cpu_env(), capture_output=True, text=True, timeout=300)
    logs = "".join(path.read_text() for path in directory.glob("process-*.log"))
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:] + logs[-3000:]
    return done.stdout + done.stderr + logs


def _global_batches(out: Path, processes: int, last_step: int) -> tuple[int, list[list[int]]]:
    """The step the run resumed from, and the global batch (row ids) of each step it ran."""
    records = [json.loads(Path(f"{out}.{i}.json").read_text()) for i in range(processes)]
    assert [record["count"] for record in records] == [processes] * processes
    restored = records[0]["restored"]
    return restored, [sum((record["ids"][k] for record in records), []) for k in range(last_step - restored)]


@pytest.fixture(scope="module", params=["arrays", "grain"])
def uninterrupted(request, tmp_path_factory):
    """(loader, the global batches of steps 1 to 12 on one process in one go)."""
    if request.param == "grain":
        pytest.importorskip("grain")
    directory = tmp_path_factory.mktemp(f"uninterrupted-{request.param}")
    _train(request.param, directory, 1, LAST, directory / "ids")
    restored, batches = _global_batches(directory / "ids", 1, LAST)
    assert restored == 0 and len(batches) == LAST and all(len(batch) == 8 for batch in batches)
    assert sorted(sum(batches[:5], [])) == list(range(40))  # an epoch: every row once
    return request.param, batches


@pytest.fixture(scope="module")
def two_to_6(uninterrupted, tmp_path_factory):
    """(the directory of `uninterrupted`'s loader trained to step 6 on two processes, its
    output): the first run of each resume from two processes, which starts from a copy."""
    loader = uninterrupted[0]
    directory = tmp_path_factory.mktemp(f"two-to-6-{loader}")
    return directory, _train(loader, directory, 2, 6, directory / "first")


@pytest.mark.processes
@pytest.mark.slow
@pytest.mark.parametrize("before, after", [(2, 1), (1, 2), (2, 4)], ids=["2-to-1", "1-to-2", "2-to-4"])
def test_a_resume_on_another_number_of_processes_sees_the_uninterrupted_global_batches(uninterrupted, tmp_path,
                                                                                       before, after, request):
    loader, expected = uninterrupted
    if before == 2:  # the same first run for each number of processes after it
        directory, first = request.getfixturevalue("two_to_6")
        shutil.copytree(directory / "run", tmp_path / "run")
        first_ids = directory / "first"
    else:
        first, first_ids = _train(loader, tmp_path, before, 6, tmp_path / "first"), tmp_path / "first"
    assert _global_batches(first_ids, before, 6) == (0, expected[:6])
    second = _train(loader, tmp_path, after, LAST, tmp_path / "second")
    assert _global_batches(tmp_path / "second", after, LAST) == (6, expected[6:])
    warned = [line for line in (first + second).splitlines() if "WARNING" in line and "is a straggler" not in line]
    assert not warned and "global position" not in second, second[-3000:]  # a straggler under load is no fault


@pytest.mark.processes
@pytest.mark.slow
def test_data_with_a_position_per_process_warns_once_naming_it_on_another_number_of_processes(tmp_path):
    """Each process counts its own batches (`jm.ResumableIterator`): a position, but not a
    global one."""
    script = tmp_path / "own.py"
    script.write_text(OWN_POSITIONS)
    for processes, last_step in ((2, 6), (1, 9)):
        command = [sys.executable, str(script), str(tmp_path / "run"), str(last_step)]
        if processes > 1:
            command = [sys.executable, "-m", "jaxmon", "launch", "-n", "2", "--log_dir", str(tmp_path), "--", *command]
        done = warm_processes.run(command, cwd=ROOT, env=cpu_env(), capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
    warnings = [line for line in done.stderr.splitlines() if "has no global position" in line]
    assert len(warnings) == 1 and "its data (a ResumableIterator)" in warnings[0], done.stderr[-3000:]
    assert "Checkpoint 6 was saved by 2 JAX processes, this run has 1" in warnings[0], warnings


OWN_POSITIONS = """\
import os, sys
import jax, jax.numpy as jnp, numpy as np
import jaxmon as jm

if os.environ.get("JAX_NUM_PROCESSES"):
    jm.distributed.initialize()
rows = [{"x": np.full((2,), jax.process_index(), np.float32)} for _ in range(100)]
mesh = jax.make_mesh((jax.device_count(),), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
with jm.MonitoredTrainingSession(lambda s, b: (s + jnp.sum(b["x"]), {}), lambda: jnp.zeros(()), mesh=mesh,
                                 data=jm.ResumableIterator(rows), checkpoint_dir=sys.argv[1],
                                 save_checkpoint_steps=3, save_summaries_steps=None, log_step_count_steps=None,
                                 hooks=[jm.StopAtStepHook(last_step=int(sys.argv[2]))]) as sess:
    while not sess.should_stop():
        sess.run()
"""
