"""Orbax's failures, told in one line and cleaned up after.

A failed save becomes one `SaveError` that names the step, the directory, the OS's
reason and the file being written; a failed restore is told by `brief`, without the
kilobytes of TensorStore spec its message carries.

Orbax runs each save and restore in a fresh asyncio event loop
(`orbax.checkpoint._src.asyncio_utils.run_sync`) and closes the loop as soon as the
operation raises, while the other reads or writes it started are still pending. Those
tasks then die with the closed loop: TensorStore's threads print "Event loop is closed"
tracebacks as their I/O completes, and the interpreter prints "Exception ignored in:
<coroutine object ...>" for each coroutine it collects, hundreds of lines after a
restore that fell back to an earlier checkpoint. `finish_failed_event_loops` makes that
loop finish (or, after `_FINISH_SECS`, cancel) its other tasks before it closes, on
failure only: a run that succeeds is untouched.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import threading
from collections.abc import Coroutine
from typing import Any

import jax
from orbax.checkpoint._src import asyncio_utils

from jaxmon._base.paths import FULL_DISK, free_bytes, size_text
from jaxmon._checkpoints import integrity as _integrity
from jaxmon._checkpoints.step_dirs import disk_bytes

logger = logging.getLogger("jaxmon")

#: How long a failed Orbax operation's loop waits for its other tasks before cancelling them.
_FINISH_SECS = 60.0
_RUN_IN_NEW_LOOP = "_run_sync_via_new_loop"  # the function of `asyncio_utils` that `run_sync` calls
_installed = threading.Lock()


class SaveError(OSError):
    """A checkpoint save failed: the step, the directory and the OS error (`errno`, when
    there is one; Orbax's error is the cause)."""


def save_error(error: BaseException, directory: str, step: int | None, kept: list[int]) -> SaveError:
    """One error that says which save failed, where, the OS's reason and the file being
    written (from TensorStore's message), and which checkpoints are kept.

    Args:
      error: Orbax's error.
      directory: the checkpoint directory.
      step: the step being saved.
      kept: the steps of the complete checkpoints left.
    """
    if isinstance(error, SaveError):
        return error
    code = re.search(r"os_error_code='(\d+)'", str(error))
    errno = getattr(error, "errno", None) or (int(code[1]) if code else None)
    reason = f"[Errno {errno}] {os.strerror(errno)}" if errno else brief(error)
    written = re.search(r'Failed writing: "([^"]+)"', str(error)) or re.search(r'local file "([^"]+)"', str(error))
    if written:  # the file TensorStore failed to write, else the database it was writing in
        path = written[1].rstrip("/")
        reason += f", writing {os.path.relpath(path, directory) if path.startswith(directory + os.sep) else path}"
    fix = "fix the cause (free space, permissions) and run again to resume from the newest"
    if errno in FULL_DISK:
        reason += f" ({_room(directory, kept)})"
        fix = ("free space there and run again to resume from the newest (or move the directory to a disk with room "
               "and resume there)")
    failure = SaveError(f"Saving checkpoint {step} to {directory} failed: {reason}. The complete checkpoints are "
                        f"kept ({'the newest: ' + str(kept[-1]) if kept else 'none yet'}); {fix}.")
    failure.errno = errno
    return failure


def _room(directory: str, kept: list[int]) -> str:
    """The room a full disk left for a checkpoint of `directory`: what the newest of the
    complete ones (`kept`) takes, and what is free there."""
    free = free_bytes(directory)
    free = "the OS does not say what is free" if free is None else f"{size_text(free)} free there"
    if not kept:
        return free
    return f"checkpoint {kept[-1]} takes {size_text(disk_bytes(os.path.join(directory, str(kept[-1]))))}; {free}"


def brief(error: BaseException, limit: int = 300) -> str:
    """An Orbax or TensorStore error in one short line: its type and the first part of its
    message, without TensorStore's spec dumps.

    Example:
      >>> brief(ValueError('NOT_FOUND: Error reading "w/.zarray" [tensorstore_spec=\\'{"driver": "zarr"}\\']'))
      'ValueError: NOT_FOUND: Error reading "w/.zarray"'
    """
    if isinstance(error, _integrity.CheckpointChangedError):
        return error.what
    text = " ".join(str(error).split())
    text = re.split(r" ?\[tensorstore_spec| ?\[source locations|\. See full TensorStore details", text)[0]
    text = re.sub(r'Error opening "\w+" driver: ', "", text)  # TensorStore's layers, before the reason
    text = f"{type(error).__name__}: {text}" if text else type(error).__name__
    return text if len(text) <= limit else text[:limit - 1] + "…"


def finish_failed_event_loops() -> None:
    """Makes Orbax's event loops finish their other tasks before closing after a failure
    (see the module's notes). Idempotent; a later Orbax without that function is left as
    it is (logged at debug level)."""
    with _installed:
        current = getattr(asyncio_utils, _RUN_IN_NEW_LOOP, None)
        if current is None:
            logger.debug("orbax.checkpoint's asyncio_utils has no %s: its event loops are left as they are.",
                         _RUN_IN_NEW_LOOP)
        elif current is not _run_in_new_loop:
            setattr(asyncio_utils, _RUN_IN_NEW_LOOP, _run_in_new_loop)


def _run_in_new_loop(coro: Coroutine[Any, Any, Any]) -> Any:
    """`asyncio_utils._run_sync_via_new_loop`, finishing the loop's other tasks when `coro` raises."""
    loop = asyncio.new_event_loop()
    try:
        asyncio.set_event_loop(loop)
        try:
            return loop.run_until_complete(coro)
        except BaseException:
            _finish_tasks(loop)
            raise
    finally:
        asyncio.set_event_loop(None)
        loop.close()


def _finish_tasks(loop: asyncio.AbstractEventLoop) -> None:
    """Runs `loop` until its tasks are done (those still running after `_FINISH_SECS` are cancelled)."""
    try:
        pending = [task for task in asyncio.all_tasks(loop) if not task.done()]
        if pending:
            _, late = loop.run_until_complete(asyncio.wait(pending, timeout=_FINISH_SECS))
            for task in late:
                task.cancel()
            if late:
                loop.run_until_complete(asyncio.wait(late))
        for task in pending:  # their errors follow the one raised: retrieved, so never "never retrieved"
            if not task.cancelled():
                task.exception()
        loop.run_until_complete(loop.shutdown_asyncgens())
    except Exception as error:  # the operation's own error is the one that matters
        logger.debug("Finishing the tasks of a failed Orbax operation: %r", error)


#: Orbax's words for an array whose shape differs from the checkpoint's.
_SHAPES = re.compile(r"Requested shape: (\([\d, ]*\)) is not compatible with the stored shape: (\([\d, ]*\))")


def none_restores(directory: str, failures: list[tuple[int, BaseException]], like: Any) -> str:
    """Why no checkpoint of `directory` restores (`failures`: each step tried and its error,
    newest first) into the state `like`: the newest one's error, or, for a state whose
    shapes changed, the leaf, both shapes and the fix (a new run that warm-starts)."""
    (step, error), steps = failures[0], ", ".join(str(s) for s, _ in failures)
    tried = f"No checkpoint in {directory} restores (step{'s' if len(failures) > 1 else ''} {steps})"
    shapes = _SHAPES.search(" ".join(str(error).split()))
    if shapes is not None:
        wanted, stored = shapes.groups()
        leaves = [jax.tree_util.keystr(path) for path, leaf in jax.tree_util.tree_leaves_with_path(like)
                  if str(tuple(getattr(leaf, "shape", ()))) == wanted]
        which = f"the state's {' or '.join(leaves[:3])}" if leaves else "a leaf of the state"
        return (f"{tried}: {which} is {wanted} where checkpoint {step} has {stored}. A model whose shapes changed "
                f"is a new run: give it a new checkpoint_dir, with warm_start={directory!r} to take the leaves "
                "that still fit.")
    return (f"{tried}; step {step}: {brief(error, 200)}. Refusing to start fresh over them: fix or move the "
            "directory, or point checkpoint_dir elsewhere.")
