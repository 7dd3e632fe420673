"""Checkpoint integrity (`jaxmon/_checkpoints/integrity.py`) on real checkpoints: a checkpoint whose
bytes changed after it was written is refused with one line naming its step and the
file, the one before it is restored, and the run trains on to the uninterrupted run's
state bit for bit; `restore_checkpoint` of that step raises; in a run that seals its
checkpoints (its other checkpoints carry manifests, or it records that it does), one whose
manifest was deleted is refused the same way. Then the manifest's own rules on plain
files, and `jaxmon train` over a deleted manifest, and over one deleted with the run's
record that it seals its checkpoints.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    ROOT,
    assert_same_checkpoint,
    kill_once_checkpointed,
    tiny_config,
    train,
    train_on,
    warnings_of,
)

import jaxmon as jm
from jaxmon._checkpoints import integrity as _integrity
from jaxmon._checkpoints.step_dirs import complete_steps

# -- a tiny Adam run on deterministic data --------------------------------------------------


def regression_arrays():
    rng = np.random.default_rng(3)
    x = rng.normal(size=(32, 128)).astype(np.float32)
    return {"x": x, "y": x @ rng.normal(size=(128, 4)).astype(np.float32)}


def adam_init():  # arrays over 1 KiB each: OCDBT keeps them in its data files, not inline
    return {"w": jnp.zeros((128, 4), jnp.float32), "mu": jnp.zeros((128, 4), jnp.float32),
            "nu": jnp.zeros((128, 4), jnp.float32)}


def adam_step(state, batch):
    def loss_fn(w):
        return jnp.mean((batch["x"] @ w - batch["y"]) ** 2)

    loss, grad = jax.value_and_grad(loss_fn)(state["w"])
    mu = 0.9 * state["mu"] + 0.1 * grad
    nu = 0.999 * state["nu"] + 0.001 * grad * grad
    return {"w": state["w"] - 0.01 * mu / (jnp.sqrt(nu) + 1e-8), "mu": mu, "nu": nu}, {"loss": loss}


def session(directory, last_step, async_save=True, integrity=True):
    hooks = [jm.CheckpointSaverHook(directory, save_steps=2, async_save=async_save, integrity=integrity),
             jm.StopAtStepHook(last_step=last_step)]
    data = jm.ArrayDataSource(regression_arrays(), batch_size=8, seed=5)  # 4 batches per epoch
    return jm.MonitoredSession(adam_step, adam_init, data=data, hooks=hooks)


def largest_file(step_directory):
    files = [os.path.join(root, name) for root, _, names in os.walk(step_directory) for name in names]
    return max(files, key=os.path.getsize)


def flip_bytes(path, count=3):
    data = bytearray(open(path, "rb").read())
    for i in range(len(data) // 2, len(data) // 2 + count):
        data[i] ^= 0xFF
    with open(path, "r+b") as file:
        file.write(data)


# -- refused, the one before restored, the same run ------------------------------------------


def test_a_changed_checkpoint_is_refused_and_the_run_goes_on_from_the_one_before_bit_for_bit(tmp_path, caplog):
    full = train_on(session(tmp_path / "full", 8))
    directory = tmp_path / "split"
    train_on(session(directory, 6))
    changed = largest_file(directory / "6")
    name = os.path.relpath(changed, directory / "6")
    assert name.startswith("state/")  # an array's data, what Orbax would restore silently
    flip_bytes(changed)

    with caplog.at_level(logging.WARNING, logger="jaxmon"):
        sess = session(directory, 8)
    [line] = warnings_of(caplog)
    assert f"Checkpoint 6 in {directory} is refused: {name} changed after it was written (crc32 " in line
    assert sess.step == 4

    train_on(sess)
    assert sess.step == 8
    for key in ("w", "mu", "nu"):
        assert np.array_equal(np.asarray(sess.state[key]), np.asarray(full.state[key])), key
    restored = jm.restore_checkpoint(directory, like=adam_init())  # this run's own step 8, sealed
    assert restored.step == 8
    assert np.array_equal(np.asarray(restored.state["nu"]), np.asarray(full.state["nu"]))


def test_restoring_the_changed_step_by_number_raises_an_error_naming_it(tmp_path, caplog):
    directory = tmp_path / "run"
    train_on(session(directory, 4, async_save=False))
    flip_bytes(largest_file(directory / "4"))
    with pytest.raises(_integrity.CheckpointChangedError, match=r"^Checkpoint 4 in .* is refused: state/.* changed"):
        jm.restore_checkpoint(directory, step=4)
    with pytest.raises(OSError, match="Checkpoint 4 "):  # given as its step directory too
        jm.restore_checkpoint(directory / "4")
    with caplog.at_level(logging.WARNING, logger="jaxmon"):
        assert jm.restore_checkpoint(directory).step == 2  # the latest that restores
    [line] = warnings_of(caplog)
    assert line.startswith(f"Checkpoint 4 in {directory} is refused: state/")


@pytest.mark.parametrize("async_save", [True, False])
def test_an_unchanged_checkpoint_restores_with_no_warning(tmp_path, caplog, async_save):
    directory = tmp_path / "run"
    first = train_on(session(directory, 4, async_save=async_save))
    for step in ("0", "2", "4"):
        manifest = json.loads((directory / step / _integrity.MANIFEST).read_text())
        assert any(name.startswith("state/") for name in manifest["files"]), manifest
    with caplog.at_level(logging.WARNING, logger="jaxmon"):
        sess = session(directory, 4)
    assert warnings_of(caplog) == []
    assert sess.step == 4 and np.array_equal(np.asarray(sess.state["w"]), np.asarray(first.state["w"]))
    sess.close()


def test_a_checkpoint_of_an_unsealed_run_restores_unchecked_and_says_so_once(tmp_path, caplog):
    directory = tmp_path / "run"
    train_on(session(directory, 2, async_save=False))
    for step in ("0", "2"):  # as a run written before integrity checks: no manifest at all
        os.remove(directory / step / _integrity.MANIFEST)
    os.remove(directory / _integrity.SEALED_RUN)
    with caplog.at_level(logging.WARNING, logger="jaxmon"):
        for _ in range(2):
            assert jm.restore_checkpoint(directory, like=adam_init()).step == 2
    assert warnings_of(caplog) == [f"Checkpoint 2 in {directory} has no {_integrity.MANIFEST} (written without one): "
                                   "it restores unchecked."]


@pytest.mark.parametrize(("async_save", "record"), [(True, "kept"), (False, "kept"), (True, "deleted")])
def test_a_sealed_run_s_checkpoint_without_its_manifest_is_refused_and_the_one_before_restores(
        tmp_path, caplog, async_save, record):
    directory = tmp_path / "run"
    train_on(session(directory, 4, async_save=async_save))
    assert json.loads((directory / _integrity.SEALED_RUN).read_text())["sealed_from"] == 0
    os.remove(directory / "4" / _integrity.MANIFEST)
    if record == "deleted":  # the checkpoints before it carry theirs: the run is sealed all the same
        os.remove(directory / _integrity.SEALED_RUN)
    flip_bytes(largest_file(directory / "4"))  # unchecked, it would restore as a wrong value
    with caplog.at_level(logging.WARNING, logger="jaxmon"):
        assert jm.restore_checkpoint(directory, like=adam_init()).step == 2
    (line,) = warnings_of(caplog)
    assert line == (f"Checkpoint 4 in {directory} is refused: its {_integrity.MANIFEST} is missing, and its run "
                    "seals every checkpoint; trying the one before it.")
    with pytest.raises(_integrity.CheckpointChangedError, match="is missing"):
        jm.restore_checkpoint(directory, step=4, like=adam_init())


@pytest.mark.parametrize("async_save", [True, False])
def test_a_saver_built_with_integrity_off_writes_no_manifest_and_its_checkpoints_restore_unchecked(
        tmp_path, caplog, async_save):
    directory = tmp_path / "run"
    train_on(session(directory, 4, async_save=async_save, integrity=False))
    assert jm.latest_checkpoint_step(directory) == 4
    assert not any(name == _integrity.MANIFEST for _, _, names in os.walk(directory) for name in names)
    assert not (directory / _integrity.SEALED_RUN).exists()
    flip_bytes(largest_file(directory / "4"))  # nothing to check it against: restored as it is
    with caplog.at_level(logging.WARNING, logger="jaxmon"):
        assert jm.restore_checkpoint(directory, like=adam_init()).step == 4
    assert [line.split(" has no ")[0] for line in warnings_of(caplog)] == [f"Checkpoint 4 in {directory}"]


def test_checkpoints_written_before_a_run_sealed_restore_unchecked_without_its_record(tmp_path, caplog):
    directory = tmp_path / "run"
    train_on(session(directory, 2, integrity=False))  # 0 and 2 unsealed, as an older jaxmon wrote them
    train_on(session(directory, 4))  # resumed with integrity on: 4 sealed
    assert json.loads((directory / _integrity.SEALED_RUN).read_text())["sealed_from"] == 4
    os.remove(directory / _integrity.SEALED_RUN)
    with caplog.at_level(logging.WARNING, logger="jaxmon"):
        assert jm.restore_checkpoint(directory, step=2, like=adam_init()).step == 2
        assert jm.restore_checkpoint(directory, like=adam_init()).step == 4
    assert warnings_of(caplog) == [f"Checkpoint 2 in {directory} has no {_integrity.MANIFEST} (written without one): "
                                   "it restores unchecked."]


# -- the manifest's rules, on plain files ----------------------------------------------------


@pytest.fixture
def step(tmp_path):
    step = tmp_path / "12"
    (step / "state" / "d").mkdir(parents=True)
    (step / "state" / "d" / "data").write_bytes(bytes(range(256)) * 64)
    (step / "_CHECKPOINT_METADATA").write_text("{}")
    _integrity.seal(step)
    return step


def test_orbax_commit_files_are_not_sealed_and_a_file_added_later_is_ignored(step):
    assert list(json.loads((step / _integrity.MANIFEST).read_text())["files"]) == ["state/d/data"]
    (step / "_CHECKPOINT_METADATA").write_text('{"commit_timestamp_nsecs": 1}')
    (step / "commit_success.txt").write_text("done")
    (step / "notes.txt").write_text("added later")
    _integrity.check(step)


@pytest.mark.parametrize(("change", "what"), [
    (lambda step: (step / "state" / "d" / "data").write_bytes(b"short"),
     "state/d/data changed after it was written (size 5 != 16384 bytes recorded)"),
    (lambda step: os.remove(step / "state" / "d" / "data"), "state/d/data is missing"),
    (lambda step: (step / _integrity.MANIFEST).write_text('{"files": '), f"its {_integrity.MANIFEST} is unreadable"),
])
def test_a_shorter_or_missing_file_or_an_unreadable_manifest_is_refused(step, change, what):
    change(step)
    with pytest.raises(_integrity.CheckpointChangedError) as error:
        _integrity.check(step)
    assert error.value.what.startswith(what) and str(error.value).startswith(f"Checkpoint 12 in {step.parent}")


@pytest.mark.parametrize("garbled", [b'{"files": {"a": ["SECRET-BYTES", 1]}}', b"\x1b[31mSECRET-BYTES\xff",
                                     b'{"files": "SECRET-BYTES"}'], ids=["bad-size", "binary", "wrong-shape"])
def test_a_garbled_manifest_is_refused_in_words_that_quote_none_of_its_bytes(step, garbled):
    (step / _integrity.MANIFEST).write_bytes(garbled)
    with pytest.raises(_integrity.CheckpointChangedError) as error:
        _integrity.check(step)
    assert error.value.what.startswith(f"its {_integrity.MANIFEST} is unreadable (not the manifest jaxmon writes: ")
    assert "SECRET" not in str(error.value) and "\x1b" not in str(error.value)


def test_sealing_a_step_in_orbaxs_temporary_directory_before_its_commit(tmp_path):
    pending = tmp_path / "8.orbax-checkpoint-tmp"
    pending.mkdir()
    (pending / "data").write_bytes(b"x" * 10)
    _integrity.seal_step(os.fspath(tmp_path), 8)
    pending.rename(tmp_path / "8")  # Orbax's commit
    _integrity.check(tmp_path / "8")
    assert "data" in (tmp_path / "8" / _integrity.MANIFEST).read_text()


def test_a_step_that_cannot_be_sealed_is_logged_and_the_save_goes_on(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="jaxmon"):
        _integrity.seal_step(os.fspath(tmp_path), 3)  # no such step directory
    [line] = warnings_of(caplog)
    assert line.startswith(f"Checkpoint 3 in {tmp_path} is saved without its {_integrity.MANIFEST}")


# -- jaxmon train over a checkpoint whose manifest was deleted ---------------------------------


def test_a_run_whose_newest_manifest_was_deleted_and_a_byte_flipped_resumes_from_the_one_before_bit_equal(
        tmp_path):
    config = tiny_config(tmp_path, steps=60, sleep=0.03)
    command = [sys.executable, "-m", "jaxmon", "train", "--config", str(config), "--workdir"]
    whole = subprocess.run([*command, str(tmp_path / "whole")], cwd=ROOT, capture_output=True, text=True,
                           timeout=300)
    assert whole.returncode == 0, whole.stderr[-3000:]
    workdir = tmp_path / "run"
    code, _, _ = kill_once_checkpointed([*command, str(workdir)], workdir, 40)
    assert code == -signal.SIGKILL and jm.latest_checkpoint_step(workdir) == 40
    os.remove(workdir / "40" / _integrity.MANIFEST)
    flip_bytes(largest_file(workdir / "40"))
    again = subprocess.run([*command, str(workdir)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    output = again.stdout + again.stderr
    refused = [line for line in output.splitlines() if "refused" in line]
    assert len(refused) == 1 and f"Checkpoint 40 in {workdir} is refused: its {_integrity.MANIFEST} is missing" \
        in refused[0], output[-3000:]
    assert "Resumed from step 20" in output
    assert_same_checkpoint(workdir, tmp_path / "whole", 60)


def test_a_run_stripped_of_its_newest_manifest_and_its_seal_record_resumes_from_the_one_before_bit_equal(
        tmp_path):
    config = tiny_config(tmp_path, steps=60)
    whole, workdir = tmp_path / "whole", tmp_path / "run"
    first = train(whole, config=config)
    assert first.returncode == 0, first.stderr[-3000:]
    assert complete_steps(whole) == [0, 20, 40, 60]
    shutil.copytree(whole, workdir)  # the whole run stays as it was, to compare with
    os.remove(workdir / "60" / _integrity.MANIFEST)  # integrity stripped: the manifest and the run's record
    os.remove(workdir / _integrity.SEALED_RUN)
    flip_bytes(largest_file(workdir / "60"), count=1)
    assert all((workdir / step / _integrity.MANIFEST).is_file() for step in ("0", "20", "40"))

    again = train(workdir, config=config)
    assert again.returncode == 0, again.stderr[-3000:]
    output = again.stdout + again.stderr
    assert "restores unchecked" not in output, output[-3000:]
    refused = [line for line in output.splitlines() if "refused" in line]
    assert len(refused) == 1 and f"Checkpoint 60 in {workdir} is refused: its {_integrity.MANIFEST} is missing, " \
        "and its run seals every checkpoint; trying the one before it." in refused[0], output[-3000:]
    assert "Resumed from step 40" in output
    assert_same_checkpoint(workdir, whole, 60)
