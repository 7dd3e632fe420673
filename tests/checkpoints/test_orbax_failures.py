"""Orbax's failures told in one line: a failed save as one `SaveError` naming the step,
the directory, the OS's reason, the file and the checkpoints kept; a failed restore
without TensorStore's spec; and a failed operation's event loop finishing its tasks."""

import asyncio
import errno
import os

import pytest
from orbax.checkpoint._src import asyncio_utils

from jaxmon._checkpoints import orbax_failures
from jaxmon._checkpoints.integrity import CheckpointChangedError
from jaxmon._checkpoints.orbax_failures import SaveError, brief, finish_failed_event_loops, save_error


def test_a_failed_save_names_the_step_the_directory_the_reason_and_the_newest_kept(tmp_path):
    error = save_error(PermissionError(errno.EACCES, "Permission denied"), str(tmp_path), 30, [10, 20])
    assert isinstance(error, SaveError) and isinstance(error, OSError) and error.errno == errno.EACCES
    assert str(error) == (f"Saving checkpoint 30 to {tmp_path} failed: [Errno 13] Permission denied. The complete "
                          "checkpoints are kept (the newest: 20); fix the cause (free space, permissions) and run "
                          "again to resume from the newest.")
    assert save_error(error, "elsewhere", 1, []) is error  # told once


def test_tensorstores_error_code_and_file_are_read_from_its_message(tmp_path):
    message = (f'UNKNOWN: Failed writing: "{tmp_path}/30.orbax-checkpoint-tmp-1/state/d/0" [os_error_code=\'5\'] '
               "[tensorstore_spec='{\"driver\": \"zarr\"}']")
    error = save_error(ValueError(message), str(tmp_path), 30, [])
    assert error.errno == errno.EIO
    assert f"failed: [Errno 5] {os.strerror(errno.EIO)}, writing 30.orbax-checkpoint-tmp-1/state/d/0." in str(error)
    assert "(none yet)" in str(error)
    elsewhere = save_error(ValueError('Error opening local file "/other/place/db"'), str(tmp_path), 30, [])
    assert elsewhere.errno is None and ", writing /other/place/db." in str(elsewhere)


def test_a_full_disk_says_what_the_newest_checkpoint_takes_and_what_is_free(tmp_path):
    (tmp_path / "20").mkdir()
    (tmp_path / "20" / "data").write_bytes(b"x" * 10000)
    error = save_error(OSError(errno.ENOSPC, "No space left on device"), str(tmp_path), 30, [20])
    text = str(error)
    assert text.startswith(f"Saving checkpoint 30 to {tmp_path} failed: [Errno 28] No space left on device "
                           "(checkpoint 20 takes ")
    assert " free there). The complete checkpoints are kept (the newest: 20); free space there and run again" in text
    assert "(checkpoint 20 takes 9.8 KB; " in text  # its 10000 bytes
    first = save_error(OSError(errno.EDQUOT, "Disk quota exceeded"), str(tmp_path), 0, [])
    assert "Disk quota exceeded (" in str(first) and "free there)" in str(first)


def test_brief_is_one_short_line_without_the_spec_dumps():
    error = ValueError('NOT_FOUND: Error opening "zarr" driver: Error reading "w/.zarray"\n'
                       "[tensorstore_spec='{\"driver\": \"zarr\", \"kvstore\": {...}}'] [source locations='x']")
    assert brief(error) == 'ValueError: NOT_FOUND: Error reading "w/.zarray"'
    assert brief(RuntimeError()) == "RuntimeError"
    long = brief(ValueError("x" * 1000), limit=50)
    assert len(long) == 50 and long.endswith("…")
    changed = CheckpointChangedError("/runs/a/7", "state/d/0 has CRC-32 1 (recorded 2)")
    assert brief(changed) == "state/d/0 has CRC-32 1 (recorded 2)"


def test_a_failed_operations_loop_finishes_its_other_tasks_before_it_closes():
    finish_failed_event_loops()
    finish_failed_event_loops()  # idempotent
    run = getattr(asyncio_utils, orbax_failures._RUN_IN_NEW_LOOP)
    assert run is orbax_failures._run_in_new_loop
    finished = []

    async def sibling():
        await asyncio.sleep(0)
        finished.append("sibling")

    async def operation():
        asyncio.get_running_loop().create_task(sibling())
        raise OSError("the write failed")

    with pytest.raises(OSError, match="the write failed"):
        run(operation())
    assert finished == ["sibling"]  # done, not left to die with the closed loop

    async def fine():
        return 42

    assert run(fine()) == 42


def test_a_state_whose_shapes_changed_names_the_leaf_both_shapes_and_warm_start(tmp_path):
    """From Python, a model made wider than its checkpoints: the restore's error names the
    leaf, its shape and the checkpoint's, and the fix (`jaxmon train` refuses the config
    change before this)."""
    import jax.numpy as jnp

    import jaxmon as jm

    def run(width):
        state = {"dense": {"kernel": jnp.zeros((width, 2)), "bias": jnp.zeros(2)}}
        with jm.MonitoredTrainingSession(lambda s, batch: (s, {"loss": 0.0}), state=state, checkpoint_dir=tmp_path,
                                         hooks=[jm.StopAtStepHook(last_step=2)], save_summaries_steps=None,
                                         log_step_count_steps=None) as sess:
            while not sess.should_stop():
                sess.run()

    run(2)
    with pytest.raises(RuntimeError) as raised:
        run(3)
    assert str(raised.value) == (
        f"No checkpoint in {tmp_path} restores (steps 2, 0): the state's ['dense']['kernel'] is (3, 2) where "
        f"checkpoint 2 has (2, 2). A model whose shapes changed is a new run: give it a new checkpoint_dir, with "
        f"warm_start={str(tmp_path)!r} to take the leaves that still fit.")
