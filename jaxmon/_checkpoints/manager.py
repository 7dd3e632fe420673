"""Checkpoints on Orbax: one writer per directory, restore of the latest good one.

A jaxmon checkpoint is an Orbax `CheckpointManager` step directory with two items:
`state` (the state pytree, `PyTreeSave`; a state that is a single array is saved
as `{"leaf": array}`) and `meta` (JSON: the step, versions, the data iterator's
position, the hooks' own state, the config). Orbax writes each step
into a temporary directory and renames it when complete, so a checkpoint cut off by
SIGKILL is never listed, never loaded; a directory counts as a step only if it is named
by the step in ASCII digits and committed (`step_dirs`). Each step directory also records the CRC-32 of
its files, checked before a restore (`integrity`): a checkpoint changed since is refused.
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import importlib.metadata
import io
import json
import logging
import operator
import os
import socket
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any, NamedTuple

import jax
import numpy as np
import orbax.checkpoint as ocp
from orbax.checkpoint import checkpoint_managers as policies

from jaxmon._base.paths import FULL_DISK, open_fd
from jaxmon._checkpoints import integrity as _integrity
from jaxmon._checkpoints.orbax_failures import SaveError, brief, finish_failed_event_loops, none_restores, save_error
from jaxmon._checkpoints.orbax_log import quiet_orbax
from jaxmon._checkpoints.step_dirs import (
    CompleteStepNames,
    complete_steps,
    is_complete,
    is_step_name,
    remove_unfinished_saves,
)
from jaxmon._ops import failures

logger = logging.getLogger("jaxmon")


FORMAT = "jaxmon-checkpoint/1"
_LOCK_NAME = ".jaxmon-writer.lock"
_LEAF = "leaf"


class Restored(NamedTuple):
    """A restored checkpoint: the state, its step, and its `meta` dict."""

    state: Any
    step: int
    meta: dict[str, Any]


def abstract_like(state: Any) -> Any:
    """The restore target of a state: shapes, dtypes and shardings, no data."""
    default = jax.sharding.SingleDeviceSharding(jax.devices()[0])

    def leaf(x):
        sharding = getattr(x, "sharding", None) or default
        if not hasattr(x, "shape"):
            x = np.asarray(x)
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)

    return jax.tree.map(leaf, state)


def versions() -> dict[str, str]:
    """The format and versions a checkpoint records, and when it was written."""
    try:
        jaxmon_version = importlib.metadata.version("jaxmon")
    except importlib.metadata.PackageNotFoundError:
        jaxmon_version = "unknown"
    return {"format": FORMAT, "jaxmon": jaxmon_version, "jax": jax.__version__, "orbax": ocp.__version__,
            "time": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")}


def check_json(value: Any, what: str) -> Any:
    """Returns `value` if JSON can write it, else raises `TypeError` naming `what`."""
    try:
        json.dumps(value, allow_nan=True)
    except (TypeError, ValueError) as error:
        raise TypeError(f"{what} must be JSON-serialisable (dicts, lists, str, numbers, None): {error}. "
                        "Convert NumPy values with int() or float(), arrays with .tolist().") from None
    return value


def _restore_args(like: Any) -> ocp.args.Composite:
    like = _wrap(like)
    restore_args = None if like is None else ocp.checkpoint_utils.construct_restore_args(like)
    return ocp.args.Composite(state=ocp.args.PyTreeRestore(like, restore_args=restore_args),
                              meta=ocp.args.JsonRestore())


def _wrap(state: Any) -> Any:
    """Orbax saves pytrees with at least one container: a bare array goes in a dict."""
    return {_LEAF: state} if state is not None and jax.tree_util.treedef_is_leaf(jax.tree.structure(state)) else state


def _unwrap(state: Any) -> Any:
    return state[_LEAF] if isinstance(state, dict) and list(state) == [_LEAF] else state


class Checkpoints:
    """The checkpoints of one directory, on one Orbax `CheckpointManager`.

    As a writer (`writer=True`), it holds an exclusive lock on the directory (a file
    lock the OS drops when the process dies, even by SIGKILL), so that two runs never
    interleave their checkpoints; only process 0 takes it. `integrity=False` saves without
    the CRC-32 manifest (`integrity`): those checkpoints restore unchecked.
    """

    def __init__(self, directory: str | os.PathLike, *, writer: bool = False, async_save: bool = True,
                 max_to_keep: int | None = None, keep_period: int | None = None,
                 keep_best: int | None = None, best_mode: str = "min", integrity: bool = True):
        self.directory = os.path.abspath(os.fspath(directory))
        self.writer = writer
        quiet_orbax()
        finish_failed_event_loops()  # a failed restore or save leaves no task of Orbax's behind
        self._lock_fd: int | None = None
        if writer:
            os.makedirs(self.directory, exist_ok=True)
            if jax.process_index() == 0:
                self._lock_fd = _lock(self.directory)
                remove_unfinished_saves(self.directory)  # held: no live run writes them
        keep: list[Any] = [policies.LatestN(max_to_keep)]  # the latest is never deleted
        if keep_period is not None:
            keep.append(policies.EveryNSteps(keep_period))
        best_of = operator.itemgetter("best")  # of the metrics save() records
        if keep_best is not None:
            keep.append(policies.BestN(get_metric_fn=best_of, n=keep_best,
                                       reverse=best_mode == "min", keep_checkpoints_without_metrics=False))
        self._async, self._sealed, self._best_mode = async_save and writer, integrity, best_mode
        options = ocp.CheckpointManagerOptions(  # a reader never saves (Orbax's read_only only adds warnings)
            enable_async_checkpointing=self._async,
            async_options=ocp.AsyncOptions(post_finalization_callback=lambda: _integrity.seal_step(
                self.directory, self._saving)) if self._async and integrity else None,
            preservation_policy=policies.AnyPreservationPolicy(keep) if writer else None,
            create=writer,
            save_root_metadata=writer,
            # Orbax writes STEP/metrics/metrics only with a best_fn: a resume ranks the earlier ones by it
            best_fn=best_of if keep_best is not None else None, best_mode=best_mode,
            step_name_format=CompleteStepNames(),  # no empty directory named like a step, no "²"
        )
        # On CPU, the state's arrays are copied to host memory for real before save()
        # returns: Orbax would otherwise keep views of them, and the next step could not
        # reuse the donated buffers. On an accelerator its own copy to the host is real
        # already (one copy; the pinned route adds a second, from pinned memory to
        # NumPy). Written uncompressed: zstd on float state saves little space and
        # costs most of the background CPU time that training loses
        # (benchmarks/checkpoint_save.py).
        pinned = jax.default_backend() == "cpu"
        handlers = {"state": ocp.PyTreeCheckpointHandler(enable_pinned_host_transfer=pinned, use_compression=False),
                    "meta": ocp.JsonCheckpointHandler()}
        try:
            self._manager = ocp.CheckpointManager(self.directory, options=options, item_handlers=handlers)
        except BaseException:
            self._unlock()
            raise
        self._failure: BaseException | None = None
        self._saving: int | None = None  # the step of the latest save started
        self._pending: _Pending | None = None  # an async save being written

    # -- writing -----------------------------------------------------------------------

    def save(self, step: int, state: Any, meta: Mapping[str, Any], best: float | None = None) -> None:
        """Starts saving `state` and `meta` as `step`; returns once the state's arrays
        are copied off the device (the rest is written in the background when async)."""
        self.wait()  # Orbax's save waits for the save before it too: here its failure names its own step
        existing = os.path.join(self.directory, str(step))
        # A step left by an earlier run that went on past where this one resumed.
        if os.path.isdir(existing) and jax.process_index() == 0:
            aside = f"{existing}.superseded-{time.strftime('%Y%m%d-%H%M%S')}"
            what = "Checkpoint %s exists from an earlier run" if is_complete(existing) else "%s is no checkpoint"
            logger.warning(what + "; moving it to %s and saving this run's step %d.", existing, aside, step)
            os.rename(existing, aside)
            self._manager.reload()
        args = ocp.args.Composite(state=ocp.args.PyTreeSave(_wrap(state)), meta=ocp.args.JsonSave(dict(meta)))
        metrics = None if best is None else {"best": float(best), "mode": self._best_mode}  # read by inspect
        if self._sealed and jax.process_index() == 0:  # before its first sealed save: from now on, fail closed
            _integrity.mark_sealed(self.directory, step)
        self._saving = step
        try:
            self._manager.save(step, args=args, metrics=metrics, force=True)
        except Exception as error:
            self._failure = self._save_error(error)
            raise self._failure from error
        if self._async:
            box = failures.current()  # the session saving: it raises a failure found in the background
            self._pending = _Pending(self._manager.wait_until_finished, step,
                                     lambda: box is not None and box.add(self._raise_found))
        elif self._sealed and jax.process_index() == 0:  # committed already
            _integrity.seal_step(self.directory, step)

    def wait(self, timeout: float | None = None) -> None:
        """Waits for the save in flight (at most `timeout` seconds) and raises its error."""
        pending = self._pending
        if pending is not None:
            with _quiet_stderr(self.directory):  # what Orbax's threads print when a save fails
                finished = pending.done.wait(timeout)
            if not finished:
                raise TimeoutError(
                    f"The checkpoint save in flight in {self.directory} did not finish within {timeout:g}s "
                    "(stop_grace_period_secs); it may be lost. Raise stop_grace_period_secs, or check the disk.")
            self._pending = None
            if pending.error is not None:
                self._failure = self._save_error(pending.error, pending.step)
                raise self._failure from pending.error
        self.raise_failure()

    def failed(self) -> bool:
        """Whether a save failed in the background and `wait()` would raise its error at once
        (a look at a flag: never waits)."""
        pending = self._pending
        return self._failure is not None or (pending is not None and pending.done.is_set()
                                             and pending.error is not None)

    def _raise_found(self, step: int) -> None:
        """Raises the `SaveError` of the save that failed in the background, noted with the
        session's `step` (training stopped there); nothing where it was raised already (by
        a later save, `wait` or `close`). The session asks after each run's step."""
        if self._failure is not None or not self.failed():
            return
        try:
            self.wait()
        except SaveError as error:
            error.stopped_at = step
            error.add_note(f"(found after step {step}: training stopped there)")
            raise

    def raise_failure(self) -> None:
        """Raises the error of an earlier save that failed in the background."""
        if self._failure is not None:
            raise self._failure
        try:
            self._manager.check_for_errors()
        except Exception as error:
            self._failure = self._save_error(error)
            raise self._failure from error

    def _save_error(self, error: BaseException, step: int | None = None) -> SaveError:
        """One error that says which save failed, where and why (Orbax's error as its cause)."""
        if not isinstance(error, Exception):  # only a waiting thread hands over any BaseException
            error = RuntimeError(repr(error))
        step = self._saving if step is None else step
        return save_error(error, self.directory, step, [s for s in complete_steps(self.directory) if s != step])

    def close(self, timeout: float | None = None) -> None:
        """Finishes pending saves (at most `timeout` seconds), then releases the lock.

        A save still running after `timeout` keeps the lock until it ends (in the
        background), so no other writer can start on the directory under it."""
        try:
            if self.writer and self._failure is None:  # a failed save was raised already
                self.wait(timeout)
        except TimeoutError:
            threading.Thread(target=self._close_now, name="jaxmon-checkpoint-close", daemon=True).start()
            raise
        except BaseException:
            self._close_now()
            raise
        self._close_now()

    def _close_now(self) -> None:
        try:
            if self._failure is None:
                self._manager.close()  # waits for a save in flight
            else:  # raised already: what Orbax's stopped threads print and raise now is noise
                with _quiet_stderr(self.directory):
                    try:
                        self._manager.close()
                    except Exception as error:
                        logger.debug("Closing %s after the failed save: %r", self.directory, error)
        finally:
            self._unlock()

    def _unlock(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # closing the descriptor drops the lock
            self._lock_fd = None

    # -- reading -----------------------------------------------------------------------

    def steps(self) -> list[int]:
        self._manager.reload()
        return sorted(self._manager.all_steps())

    def restore(self, step: int, like: Any) -> Restored:
        required = _integrity.manifest_required(self.directory, step)
        if not _integrity.check(os.path.join(self.directory, str(step)), required):  # raises CheckpointChangedError
            _say_unsealed(self.directory, step)
        if like is None:
            like = self._default_target(step)
        restored = self._manager.restore(step, args=_restore_args(like))
        return Restored(_unwrap(restored["state"]), step, dict(restored["meta"] or {}))

    def _default_target(self, step: int) -> Any:
        """Without a target: the saved shapes and dtypes, on this process's first device
        (a checkpoint saved sharded over devices that are not here restores too)."""
        try:
            tree = self._manager.item_metadata(step)["state"].tree
        except Exception:  # no metadata to read: let Orbax decide
            return None
        leaves = jax.tree.leaves(tree, is_leaf=lambda x: hasattr(x, "shape") and hasattr(x, "dtype"))
        if not leaves or not all(hasattr(x, "shape") and hasattr(x, "dtype") for x in leaves):
            return None
        device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        target = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=device), tree,
                              is_leaf=lambda x: hasattr(x, "shape") and hasattr(x, "dtype"))
        return _unwrap(target)

    def restore_latest(self, like: Any) -> Restored | None:
        """The latest checkpoint that restores; a broken one is reported and skipped.

        Returns None when the directory has no checkpoint. Raises when it has some but
        none restores: a run never starts fresh over checkpoints it could not read.
        """
        failures = []
        for step in reversed(self.steps()):
            try:
                restored = self.restore(step, like)
            except _integrity.CheckpointChangedError as error:
                logger.warning("Checkpoint %d in %s is refused: %s; trying the one before it.",
                               step, self.directory, error.what)
                failures.append((step, error))
                continue
            except Exception as error:
                logger.error("Checkpoint %s/%d does not restore (%s); trying the one before it.",
                             self.directory, step, brief(error))
                logger.debug("Checkpoint %s/%d does not restore.", self.directory, step, exc_info=error)
                failures.append((step, error))
                continue
            if broken := [s for s, e in failures if not isinstance(e, _integrity.CheckpointChangedError)]:
                logger.warning("Restored checkpoint %d of %s instead of the broken %s.", step, self.directory, broken)
            return restored
        if failures:  # the first (newest) one's error is the cause, in full
            raise RuntimeError(none_restores(self.directory, failures, like)) from failures[0][1]
        return None


_SAID_UNSEALED: set[tuple[str, int]] = set()


def _say_unsealed(directory: str, step: int) -> None:
    """Says once per process that checkpoint `step` of `directory` restores unchecked."""
    if (directory, step) not in _SAID_UNSEALED:
        _SAID_UNSEALED.add((directory, step))
        logger.warning("Checkpoint %d in %s has no %s (written without one): it restores unchecked.", step,
                       directory, _integrity.MANIFEST)


@contextlib.contextmanager
def _quiet_stderr(directory: str):
    """Keeps what other threads print meanwhile (Orbax's, after a failed save: "Event
    loop is closed" tracebacks) off the terminal, in jaxmon's debug log."""
    with contextlib.redirect_stderr(io.StringIO()) as printed:
        yield
    if printed.getvalue():
        logger.debug("Printed while saving to %s:\n%s", directory, printed.getvalue())


class _Pending:
    """A save being written in the background: a thread waits for it (`wait`) and keeps
    its error, which the session sees after its next run (`Checkpoints._raise_found`), not
    at the next save; `failed()` is called from that thread when the save failed."""

    def __init__(self, wait: Callable[[], None], step: int, failed: Callable[[], None]):
        self.step, self.error, self.done = step, None, threading.Event()
        threading.Thread(target=self._wait, args=(wait, failed), name=f"jaxmon-save-{step}", daemon=True).start()

    def _wait(self, wait: Callable[[], None], failed: Callable[[], None]) -> None:
        try:
            wait()
        except BaseException as error:  # handed to the thread that waits, or polls, next
            self.error = error
            failed()
        finally:
            self.done.set()


class DirectoryInUseError(RuntimeError):
    """Another run holds the writer's lock of a checkpoint directory."""


def _lock(directory: str) -> int:
    path = os.path.join(directory, _LOCK_NAME)
    fd = open_fd(path, os.O_RDWR | os.O_CREAT, 0o644)  # a link there is refused (LinkedFileError)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        try:
            holder = os.pread(fd, 4096, 0).decode(errors="replace").strip() or "another writer"
        finally:
            os.close(fd)
        raise DirectoryInUseError(
            f"Checkpoint directory {directory} is being written by {holder}. Two runs must not write "
            "one checkpoint_dir: stop the other run, or give this one its own checkpoint_dir.") from None
    stamp = datetime.datetime.now().isoformat(timespec="seconds")
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()} since {stamp}\n".encode(), 0)
    except OSError as error:  # a full disk, say: name the file
        os.close(fd)
        fix = "free space there" if error.errno in FULL_DISK else "check that disk"
        raise OSError(error.errno, f"{error.strerror}, writing {path}: {fix} (or give the run another directory) "
                                   "and run again") from error
    return fd


def restore_checkpoint(directory: str | os.PathLike, *, step: int | None = None, like: Any = None) -> Restored:
    """Reads a jaxmon checkpoint (for an evaluator, a notebook, or a warm start).

    Args:
      directory: a `checkpoint_dir` of a training run, or one checkpoint's directory
        in it (as `checkpoints_iterator` yields).
      step: which checkpoint (default: the latest that restores).
      like: a state (or `jax.eval_shape` of one) to restore into, with its pytree type
        and shardings; None gives nested dicts of arrays.

    Returns:
      `Restored(state, step, meta)`.

    Example:
      >>> import jaxmon as jm
      >>> restored = jm.restore_checkpoint("runs/train")  # doctest: +SKIP
    """
    if step is None and os.path.exists(os.path.join(directory, "_CHECKPOINT_METADATA")):
        directory, name = os.path.split(os.path.abspath(directory))
        if not is_step_name(name):
            raise ValueError(f"{os.path.join(directory, name)} holds a checkpoint, but {name!r} names no step (ASCII "
                             f"digits, as jaxmon names them): give its parent directory and step=, or rename it.")
        step = int(name)
    checkpoints = Checkpoints(directory)
    try:
        target = None if like is None else abstract_like(like)
        with warnings.catch_warnings():  # without a target, arrays go to the default device, as documented
            warnings.filterwarnings("ignore", "Sharding info not provided when restoring")
            restored = checkpoints.restore(step, target) if step is not None else checkpoints.restore_latest(target)
        if restored is None:
            raise FileNotFoundError(f"No checkpoint in {os.path.abspath(directory)}.")
        return restored
    finally:
        checkpoints.close()


def checkpoints_iterator(directory: str | os.PathLike, *, timeout: float | None = None, poll_secs: float = 1.0,
                         timeout_fn: Callable[[], bool] | None = None) -> Iterator[str]:
    """Yields the path of each new complete checkpoint in `directory` as a run writes it
    (TF's `tf.train.checkpoints_iterator`, for a side-car evaluator).

    The first item is the latest checkpoint already there, if any; then each newer one,
    skipping those that were superseded between two looks. Stops when no new
    checkpoint came for `timeout` seconds and `timeout_fn()` (if given) returns True.

    Example:
      >>> import jaxmon as jm
      >>> for path in jm.checkpoints_iterator("runs/train", timeout=600):  # doctest: +SKIP
      ...     state, step, meta = jm.restore_checkpoint(path, like=init_fn())
    """
    def newer_than(last: int | None) -> int | None:
        steps = complete_steps(directory)
        return steps[-1] if steps and (last is None or steps[-1] > last) else None

    last: int | None = None
    while True:
        deadline = None if timeout is None else time.monotonic() + timeout
        newest = newer_than(last)
        while newest is None and (deadline is None or time.monotonic() < deadline):
            time.sleep(poll_secs)
            newest = newer_than(last)
        if newest is not None:
            last = newest
            yield os.path.join(os.fspath(directory), str(last))
        elif timeout_fn is None or timeout_fn():
            return
