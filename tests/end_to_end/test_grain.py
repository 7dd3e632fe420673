"""grain pipelines in a session: exact resume after SIGKILL, worker processes stopped on
every exit path, bytes and dict positions in checkpoints, and the example.

The training runs are real processes (tests/end_to_end/grain_worker.py) with 2 grain
worker processes each; the SIGKILL goes to the whole process group, workers included, as when
a machine is lost.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import warm_processes
from helpers import cpu_env

from jaxmon._checkpoints import manager as _checkpoint
from jaxmon._checkpoints import step_dirs as _step_dirs

pytest.importorskip("grain")  # the jaxmon[grain] extra (installed by `make test`)

WORKER = Path(__file__).with_name("grain_worker.py")
LAST_STEP = 30


def _train(loader: str, directory: Path, out: Path, *extra: str) -> subprocess.Popen:
    return warm_processes.popen([sys.executable, str(WORKER), loader, str(directory), str(LAST_STEP), str(out), *extra],
                                env=cpu_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)


def _finish(process: subprocess.Popen) -> str:
    """Waits for a trainer: it must exit 0, with none of its grain workers left."""
    output, _ = process.communicate(timeout=240)
    assert process.returncode == 0, output[-3000:]
    assert _group_gone(process.pid), f"grain workers of {process.pid} still run"
    return output


def _group_gone(pgid: int, timeout: float = 20.0) -> bool:
    """Whether every process of the group (the trainer and grain's workers) has ended."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    return False


def _complete(directory: Path, step: int) -> bool:
    return step in _checkpoint.complete_steps(directory)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """Both loaders trained to LAST_STEP without a stop (run side by side)."""
    root = tmp_path_factory.mktemp("grain_full")
    runs = {kind: _train(kind, root / kind, root / f"{kind}.npz") for kind in ("dataset", "dataloader")}
    for process in runs.values():
        _finish(process)
    return root


@pytest.mark.slow
@pytest.mark.parametrize("loader", ["dataset", "dataloader"])
def test_a_grain_run_killed_after_a_checkpoint_resumes_bit_identical(loader, uninterrupted, tmp_path):
    directory, out = tmp_path / "run", tmp_path / "out.npz"
    process = _train(loader, directory, out, "--slow-after", "11")
    deadline = time.monotonic() + 120
    while not _complete(directory, 10):  # the checkpoint of step 10 is written; steps 11+ run on
        assert process.poll() is None and time.monotonic() < deadline, process.communicate()[0][-3000:]
        time.sleep(0.1)
    time.sleep(1.0)  # a few steps past it, with batches taken ahead by the session and by grain
    os.killpg(process.pid, signal.SIGKILL)
    process.wait(timeout=30)
    assert _group_gone(process.pid)

    _finish(_train(loader, directory, out))
    resumed, full = np.load(out), np.load(uninterrupted / f"{loader}.npz")
    restored = int(resumed["restored"])
    assert restored >= 10
    # The steps after the restored one saw exactly the rows of the uninterrupted run ...
    np.testing.assert_array_equal(resumed["ids"], full["ids"][restored:])
    # ... and the parameters are bit-identical.
    assert resumed["w"].tobytes() == full["w"].tobytes()


def test_positions_are_kept_as_json_in_the_checkpoint_a_dataloaders_bytes_as_text(uninterrupted):
    dataset = _step_dirs.read_meta(uninterrupted / "dataset" / str(LAST_STEP))["data"]
    assert isinstance(dataset, dict) and "iterators_in_use_states" in dataset  # grain's own dict
    dataloader = _step_dirs.read_meta(uninterrupted / "dataloader" / str(LAST_STEP))["data"]
    assert set(dataloader) == {"__bytes__"}  # grain.DataLoader's bytes: JSON text
    state = json.loads(dataloader["__bytes__"])
    assert state["worker_count"] == 2 and state["data_source"] == "Rows(96)"


@pytest.mark.parametrize("loader", ["dataset", "dataloader"])
def test_sigterm_saves_stops_and_shuts_the_grain_workers_down(loader, tmp_path):
    directory, out = tmp_path / "run", tmp_path / "out.npz"
    process = _train(loader, directory, out, "--slow-after", "3")
    for line in process.stdout:
        if line.startswith("STEP 5"):
            break
    os.kill(process.pid, signal.SIGTERM)  # the trainer only, as a scheduler's preemption notice
    _finish(process)  # exit 0 after the session saved, and no worker left behind
    stopped = int(np.load(out)["ids"].shape[0])
    assert 5 <= stopped < LAST_STEP
    assert _checkpoint.complete_steps(directory)[-1] == stopped
