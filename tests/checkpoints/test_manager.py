"""The checkpoints of a directory (`Checkpoints`, `restore_checkpoint`): one writer per
directory, saves restored as they were saved, the latest good one, and the config and
metadata a checkpoint can hold."""

import os
import select
import shutil
import subprocess
import sys
import textwrap
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import warm_processes
from helpers import count_step, cpu_env, zero

import jaxmon as jm
from jaxmon._checkpoints.manager import (
    Checkpoints,
    DirectoryInUseError,
    check_json,
    complete_steps,
    restore_checkpoint,
    versions,
)


def train(hooks, last_step, step_fn=count_step, init_fn=zero, **kwargs):
    """Runs a session until `last_step` (a StopAtStepHook is added last) and closes it."""
    with jm.MonitoredSession(step_fn, init_fn, hooks=[*hooks, jm.StopAtStepHook(last_step=last_step)],
                             **kwargs) as sess:
        while not sess.should_stop():
            sess.run()
    return sess


def test_a_restore_of_one_step_directory_and_without_like(tmp_path):
    directory = tmp_path / "ckpt"
    train([jm.CheckpointSaverHook(directory, save_steps=3)], last_step=3)
    restored = jm.restore_checkpoint(os.path.join(directory, "3"))  # a step's own directory
    assert restored.step == 3 and int(np.asarray(restored.state)) == 3


def test_a_config_that_json_cannot_write_raises_type_error_naming_it(tmp_path):
    with pytest.raises(TypeError, match="config"):
        jm.MonitoredSession(count_step, zero, hooks=[jm.CheckpointSaverHook(tmp_path / "ckpt", save_steps=1)],
                            config={"array": np.zeros(2)})
    assert complete_steps(tmp_path / "ckpt") == []


def test_a_second_writer_in_this_process_is_refused_until_the_first_closes(tmp_path):
    directory = tmp_path / "ckpt"
    first = jm.MonitoredSession(count_step, zero, hooks=[jm.CheckpointSaverHook(directory, save_steps=1)])
    try:
        first.run()
        with pytest.raises(RuntimeError) as info:
            jm.MonitoredSession(count_step, zero, hooks=[jm.CheckpointSaverHook(directory, save_steps=1)])
        assert os.fspath(directory) in str(info.value) and f"pid {os.getpid()}" in str(info.value)
        first.run()  # the refused writer took nothing from the first one
    finally:
        first.close()
    assert complete_steps(directory) == [0, 1, 2]
    hook = jm.CheckpointSaverHook(directory, save_steps=1)
    sess = train([hook], last_step=3)  # after the first closed, a new writer works (and resumes)
    assert sess.step == 3 and hook.saved_steps == [3] and complete_steps(directory) == [0, 1, 2, 3]


CHILD = textwrap.dedent("""
    import os, sys, time
    import jax.numpy as jnp
    import jaxmon as jm
    sess = jm.MonitoredSession(lambda s, b: (s + 1, {}), lambda: jnp.zeros(()),
                               hooks=[jm.CheckpointSaverHook(sys.argv[1], save_steps=1)])
    print("ready", os.getpid(), flush=True)
    time.sleep(120)
""")


def test_a_directory_held_by_another_process_is_refused(tmp_path):
    directory = tmp_path / "ckpt"
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    child = warm_processes.popen([sys.executable, str(script), str(directory)], env=cpu_env(), stdout=subprocess.PIPE,
                                 stderr=subprocess.DEVNULL, text=True)
    try:
        deadline = time.monotonic() + 60
        line = ""
        while not line.startswith("ready"):
            remaining = deadline - time.monotonic()
            assert remaining > 0 and child.poll() is None, f"the child did not get ready (rc={child.poll()})"
            if select.select([child.stdout], [], [], remaining)[0]:
                line = child.stdout.readline()
        assert line.split() == ["ready", str(child.pid)]
        with pytest.raises(RuntimeError) as info:
            jm.MonitoredSession(count_step, zero, hooks=[jm.CheckpointSaverHook(directory, save_steps=1)])
        assert f"pid {child.pid}" in str(info.value) and os.fspath(directory) in str(info.value)
    finally:
        child.kill()
        child.wait(30)
        child.stdout.close()
    # the OS dropped the lock of the killed writer: a new one works
    hook = jm.CheckpointSaverHook(directory, save_steps=1)
    sess = train([hook], last_step=1, init_fn=lambda: jnp.zeros(()))
    assert sess.step == 1 and 1 in complete_steps(directory)


def saved(directory, steps, make=lambda step: {"w": jnp.full((3,), float(step)), "n": jnp.int32(step)}, **kwargs):
    """A writer's checkpoints of `steps` in `directory`, each of `make(step)` (saved whole
    before the writer closes); returns the directory."""
    checkpoints = Checkpoints(directory, writer=True, async_save=False, **kwargs)
    try:
        for step in steps:
            checkpoints.save(step, make(step), {"step": step, "note": f"saved at {step}"})
    finally:
        checkpoints.close()
    return directory


def test_a_save_restores_as_it_was_saved_with_its_meta_and_a_single_array_too(tmp_path):
    saved(tmp_path / "tree", [2, 5])
    reader = Checkpoints(tmp_path / "tree")
    try:
        assert reader.steps() == [2, 5]
        restored = reader.restore(2, {"w": jnp.zeros(3), "n": jnp.int32(0)})
        assert restored.step == 2 and restored.meta == {"step": 2, "note": "saved at 2"}
        np.testing.assert_array_equal(restored.state["w"], np.full(3, 2.0))
        assert int(restored.state["n"]) == 2
        assert reader.restore_latest(None).step == 5  # without a target: the saved shapes and dtypes
    finally:
        reader.close()
    saved(tmp_path / "leaf", [1], make=lambda step: jnp.arange(4.0))  # a state that is one array
    restored = restore_checkpoint(tmp_path / "leaf", like=jnp.zeros(4))
    np.testing.assert_array_equal(restored.state, np.arange(4.0))


def test_max_to_keep_leaves_the_latest_and_a_writer_replaces_a_step_an_earlier_run_left(tmp_path, caplog):
    saved(tmp_path, [1, 2, 3], max_to_keep=2)
    assert complete_steps(tmp_path) == [2, 3]
    saved(tmp_path, [3], make=lambda step: {"w": jnp.full((3,), 30.0), "n": jnp.int32(30)})  # a resumed run
    assert any("Checkpoint" in r.getMessage() and "exists from an earlier run" in r.getMessage()
               for r in caplog.records)
    assert int(restore_checkpoint(tmp_path, step=3).state["n"]) == 30
    assert [name for name in os.listdir(tmp_path) if name.startswith("3.superseded-")]  # the old one, moved aside


def test_a_second_writer_of_a_directory_is_refused_naming_the_holder(tmp_path):
    first = Checkpoints(tmp_path, writer=True)
    try:
        with pytest.raises(DirectoryInUseError, match=rf"is being written by pid {os.getpid()} on "):
            Checkpoints(tmp_path, writer=True)
        Checkpoints(tmp_path).close()  # a reader takes no lock
    finally:
        first.close()
    Checkpoints(tmp_path, writer=True).close()  # the lock went with the first


def test_restore_latest_skips_a_broken_checkpoint_and_refuses_when_none_restores(tmp_path, caplog):
    saved(tmp_path, [1, 2], integrity=False)  # no manifest: Orbax itself finds what is missing
    for name in os.listdir(tmp_path / "2" / "state"):
        path = tmp_path / "2" / "state" / name
        if path.is_dir():
            shutil.rmtree(path)  # step 2's arrays are gone
    restored = restore_checkpoint(tmp_path)
    assert restored.step == 1
    assert any("instead of the broken [2]" in r.getMessage() for r in caplog.records)
    shutil.rmtree(tmp_path / "1" / "state")
    with pytest.raises(RuntimeError, match=r"No checkpoint in .* restores \(steps 2, 1\)"):
        restore_checkpoint(tmp_path)


def test_restore_checkpoint_of_no_checkpoint_or_a_step_directory_not_named_by_its_step(tmp_path):
    with pytest.raises(FileNotFoundError, match="No checkpoint in"):
        restore_checkpoint(tmp_path)
    saved(tmp_path / "run", [4])
    os.rename(tmp_path / "run" / "4", tmp_path / "copy")
    with pytest.raises(ValueError, match="'copy' names no step"):
        restore_checkpoint(tmp_path / "copy")


def test_checkpoints_iterator_yields_the_latest_then_each_newer_until_the_timeout_fn_says_stop(tmp_path):
    saved(tmp_path, [1, 2])
    asked = []

    def timeout_fn():  # no new checkpoint came: a writer saves step 5, then none more
        asked.append(1)
        if len(asked) == 1:
            saved(tmp_path, [5])
            return False
        return True

    paths = list(jm.checkpoints_iterator(tmp_path, timeout=0, poll_secs=0, timeout_fn=timeout_fn))
    assert paths == [os.path.join(tmp_path, "2"), os.path.join(tmp_path, "5")] and len(asked) == 2


def test_a_config_must_be_json_and_the_versions_name_jax_orbax_and_jaxmon():
    assert check_json({"lr": 0.1, "layers": [2, 3]}, "config") == {"lr": 0.1, "layers": [2, 3]}
    with pytest.raises(TypeError, match="config"):
        check_json({"array": np.zeros(2)}, "config")
    assert versions()["format"] == "jaxmon-checkpoint/1" and versions()["jax"] == jax.__version__
    assert set(versions()) == {"format", "jaxmon", "jax", "orbax", "time"}

