"""Data in a session: iterators without a position (`jm.ResumableIterator`), positions
that are bytes, and batches the step cannot take. (ArrayDataSource: tests/data/test_arrays.py.)"""

from __future__ import annotations

import logging
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest
import warm_processes
from helpers import ROOT, cpu_env, run_jaxmon

import jaxmon as jm
from jaxmon._checkpoints import manager as _checkpoint
from jaxmon._checkpoints import step_dirs as _step_dirs
from jaxmon._run.batches import BatchSource


def add_x(state, batch):
    state = state * 1.5 + jnp.sum(batch["x"])  # the order of the batches changes the result
    return state, {"total": state}


class Loader:
    """A loader without a position, as a torch DataLoader: each `iter()` starts over."""

    def __init__(self, count: int):
        self.count, self.passes = count, 0

    def __iter__(self):
        self.passes += 1
        return iter([{"x": np.full((2,), float(i))} for i in range(self.count)])


def _train(data, directory, last_step):
    with jm.MonitoredTrainingSession(add_x, lambda: jnp.zeros(()), data=data, checkpoint_dir=directory,
                                     hooks=[jm.StopAtStepHook(last_step=last_step)], save_checkpoint_steps=3,
                                     save_summaries_steps=None, log_step_count_steps=None) as sess:
        while not sess.should_stop():
            sess.run()
    return float(sess.state), sess.step


def test_a_resumable_iterator_replays_the_consumed_batches_and_resumes_exactly(tmp_path, caplog):
    full, _ = _train(jm.ResumableIterator(Loader(5), repeat=True), tmp_path / "full", 12)
    _train(jm.ResumableIterator(Loader(5), repeat=True), tmp_path / "run", 6)  # 6 batches: past one epoch
    meta = _step_dirs.read_meta(tmp_path / "run" / "6")
    assert meta["data"] == {"batches": 6}  # the batches taken ahead are not counted
    loader = Loader(5)
    with caplog.at_level(logging.WARNING, logger="jaxmon"):
        resumed, step = _train(jm.ResumableIterator(loader, repeat=True), tmp_path / "run", 12)
    assert step == 12 and resumed == full
    assert "Replaying the 6 batches consumed before the checkpoint" in caplog.text
    assert loader.passes >= 2  # the replay went through the first epoch again


def test_a_resumable_iterator_takes_a_function_and_refuses_a_one_shot_iterator():
    batches = jm.ResumableIterator(lambda: iter(range(3)))
    assert [next(batches), next(batches)] == [0, 1]
    batches.set_state({"batches": 1})
    assert next(batches) == 1 and batches.get_state() == {"batches": 2}
    assert list(batches) == [2]  # then the data ends: StopIteration, a clean stop in a session
    with pytest.raises(ValueError, match="ended after 3 batches, before the 5"):
        batches.set_state({"batches": 5})
    with pytest.raises(TypeError, match="lambda: ds.as_numpy_iterator"):
        jm.ResumableIterator(iter(range(3)))


class BytesPositions:
    """An iterator whose position is bytes, as a grain.DataLoader's."""

    def __init__(self):
        self.index = 0

    def __iter__(self):
        return self

    def __next__(self):
        self.index += 1
        return {"x": np.full((2,), float(self.index))}

    def get_state(self) -> bytes:
        return f'{{"index": {self.index}}}'.encode()

    def set_state(self, state: bytes) -> None:
        assert isinstance(state, bytes)
        self.index = int(state.decode().split(":")[1].rstrip("}"))


def test_a_bytes_position_is_saved_as_text_and_given_back_as_bytes():
    data = BytesPositions()
    source = BatchSource(data, 1, lambda step, limit: limit, prefetch=2)
    source.next(0)  # one batch run, two taken ahead
    assert source.position() == {"__bytes__": '{"index": 1}'}
    source.restore({"__bytes__": '{"index": 1}'}, 1, recovering=False)
    assert data.index == 1
    source.give_back()  # an iterator the caller gave stays open, at its first batch not run


def test_a_batch_with_text_names_the_step_and_the_key():
    with jm.MonitoredSession(add_x, state=jnp.zeros(())) as sess:
        sess.run({"x": np.ones(2)})
        sess.run({"x": np.ones(2)})
        with pytest.raises(TypeError, match=r"batch\['name'\] of step 3 is not an array of numbers: str 'a cat'"):
            sess.run({"x": np.ones(2), "name": "a cat"})
    with jm.MonitoredSession(add_x, state=jnp.zeros(())) as sess:
        with pytest.raises(TypeError, match=r"batch\['x'\] of step 1 is not an array of numbers: ndarray"):
            sess.run({"x": np.array(["a", "b"])})


def test_a_batch_with_no_rows_names_the_step_and_the_key():
    with jm.MonitoredSession(add_x, state=jnp.zeros(()), data=[{"x": np.ones(2)}, {"x": np.ones(0)}]) as sess:
        sess.run()
        with pytest.raises(ValueError, match=r"batch of step 2 is empty: batch\['x'\] has 0 rows"):
            sess.run()


def _cli(*args: str) -> subprocess.CompletedProcess:
    result = run_jaxmon(["train", "--config", ROOT / "configs" / "default.py", *args], cwd=ROOT, env=cpu_env(),
                        timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


@pytest.mark.slow
def test_jaxmon_train_switches_to_grain_from_a_config_key_and_resumes_it(tmp_path):
    pytest.importorskip("grain")
    common = ("--workdir", str(tmp_path), "--config.data.loader=grain", "--config.data.worker_count=2",
              "--config.data.batch_size=16",  # grain's workers take ~0.2 ms of CPU a row
              "--config.session.save_checkpoint_steps=40", "--config.hooks.1.every_n_steps=1000")
    _cli(*common, "--config.steps=40")
    position = _step_dirs.read_meta(tmp_path / "40")["data"]
    assert position["global_batch"] == 16  # a global position: it resumes on any number of processes
    assert "iterators_in_use_states" in position["position"]  # grain's iterator state, with 2 workers
    resumed = _cli(*common, "--config.steps=80")
    assert "Restored step 40" in resumed.stderr + resumed.stdout
    assert _checkpoint.complete_steps(tmp_path)[-1] == 80


@pytest.mark.slow
def test_the_grain_example_trains_and_resumes(tmp_path):
    pytest.importorskip("grain")
    example = [sys.executable, str(ROOT / "examples" / "grain_pipeline.py"), "--workdir", str(tmp_path),
               "--batch_size", "16"]  # grain's workers take ~0.2 ms of CPU a row
    first = warm_processes.run([*example, "--steps", "150"], capture_output=True, text=True, timeout=300,
                               env=cpu_env())
    assert first.returncode == 0, first.stderr[-3000:]
    second = warm_processes.run([*example, "--steps", "300"], capture_output=True, text=True, timeout=300,
                                env=cpu_env())
    assert second.returncode == 0, second.stderr[-3000:]
    line = second.stdout.strip().splitlines()[-1]
    assert line.startswith("step 300 (resumed from 150): test accuracy") and line.endswith("2 grain workers")
    assert float(line.split("accuracy ")[1].split(",")[0]) > 0.85


class _CountedRows:
    """Rows of `np.arange(n)` that count how many were read."""

    def __init__(self, n):
        self.n, self.reads = n, 0

    def __len__(self):
        return self.n

    def __getitem__(self, index):
        self.reads += 1
        return np.float32(index)


def test_the_grain_loader_reads_no_batches_ahead_of_those_taken():
    """The rows are in memory: the pipeline of `data.loader: "grain"` reads a row when its
    batch is taken (in the workers: when a worker builds its next batch), not hundreds of
    batches ahead as grain's defaults for slow storage would (16 threads, 500 batches)."""
    pytest.importorskip("grain")
    from jaxmon._data.loaders import array_pipeline

    rows = _CountedRows(10_000)
    batches = iter(array_pipeline({"x": rows}, 10, seed=0, worker_count=0))
    taken = [next(batches)["x"] for _ in range(3)]
    assert [batch.shape for batch in taken] == [(10,)] * 3
    assert sorted(np.concatenate(taken).astype(int).tolist()) == sorted(set(np.concatenate(taken).astype(int).tolist()))
    assert rows.reads <= 40, rows.reads  # 30 rows taken; the defaults read thousands
