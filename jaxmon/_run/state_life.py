"""The state's life in a session: built, restored, warm-started, recovered, and what a
checkpoint keeps beside it."""

from __future__ import annotations

import itertools
import json
import logging
import os
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import numpy as np

from jaxmon import _writers
from jaxmon._base import errors as _errors
from jaxmon._base.hook import Hook, Saver
from jaxmon._base.triggers import SecondOrStepTimer
from jaxmon._checkpoints import manager as _checkpoint
from jaxmon._checkpoints import warm_start as _warm_start
from jaxmon._metrics.accumulators import Accumulators
from jaxmon._ops.time_spent import TimeSpent
from jaxmon._run import sharding as _sharding
from jaxmon._run.batches import BatchSource

logger = logging.getLogger("jaxmon")


class Snapshot(NamedTuple):
    """What a checkpoint of one step holds: the step, the state, and its metadata
    (`MonitoredSession.resume_info()`)."""

    step: int
    state: Any
    meta: dict[str, Any]


class StateLife:
    """Builds the session's state, or restores it with its step, data position and
    hook states, and says what a checkpoint of it must hold (`resume_info`).

    Args:
      init_fn: builds a fresh state; None when `state` is given instead.
      state: the initial state itself (it can be used once: it is donated).
      placement: a sharded session's `sharding.Placement`, or None.
      checkpoint_dir: where to restore from; None: the `checkpoint_dir` of the first
        hook that has one, if any.
      warm_start: a checkpoint path or `fn(state) -> state`, applied to fresh states.
      initial_step: the step number of a fresh state.
      config: a JSON-serialisable dict saved in every checkpoint's metadata.
      hooks: the session's hooks, whose states checkpoints keep.
      batches: the session's data, whose position checkpoints keep.
      accumulators: the hooks' reductions, whose open windows checkpoints keep.
      max_recoveries: how many recoverable errors a creation retries.
      donate_state: whether the step takes the state's buffers (then leaves sharing a
        buffer are copied apart first: `unaliased`).
    """

    def __init__(self, init_fn: Callable[[], Any] | None, state: Any, *, placement: _sharding.Placement | None,
                 checkpoint_dir: str | os.PathLike | None, warm_start: Any, initial_step: int,
                 config: Mapping[str, Any] | None,
                 hooks: tuple[Hook, ...], batches: BatchSource, accumulators: Accumulators, max_recoveries: int,
                 donate_state: bool = True, spent: TimeSpent | None = None):
        self._spent = TimeSpent() if spent is None else spent
        self._make_state = init_fn if init_fn is not None else _once(state)
        self._init_fn = self._make_state
        if placement is not None:
            self._init_fn = lambda make=self._make_state, place=placement.place_state: place(make())
        self._placement = placement
        self._like = (None if state is None else _checkpoint.abstract_like(state) if placement is None
                      else placement.like(state))  # a state given is its own restore target (it is made once)
        if checkpoint_dir is None:
            checkpoint_dir = next((saver.checkpoint_dir for saver in _savers(hooks)), None)
        self.checkpoint_dir = None if checkpoint_dir is None else os.fspath(checkpoint_dir)
        self._warm_start = warm_start
        self._initial_step = initial_step
        self._config = None if config is None else _checkpoint.check_json(dict(config), "config")
        self._hooks, self._batches, self._accumulators = hooks, batches, accumulators
        self.max_recoveries, self._donate_state = max_recoveries, donate_state
        #: The step of the checkpoint the session was created from (None: a fresh start).
        self.restored_step: int | None = None
        self.warm_start_report: _warm_start.WarmStartReport | None = None
        #: Why the current state must not be saved (None: it may be).
        self.rejected: str | None = None
        #: True when the last creation set the data back to a checkpoint's position.
        self.data_rewound = False
        #: The hooks' open windows in the checkpoint restored last (None: start afresh).
        self.windows: dict[str, Any] | None = None
        self._restored_config: Any = None

    def create(self, ready: Callable[[Any, int], None], recovering: BaseException | None = None) -> None:
        """Restores the latest checkpoint or builds a fresh state and passes it to
        `ready(state, step)` (which tells the hooks); retries recoverable errors.

        Args:
          ready: takes the new state and its step number.
          recovering: the recoverable error that makes the session re-create its
            state, or None at the session's creation.
        """
        for attempt in itertools.count(1):
            try:
                ready(*self._restore_or_init(recovering))
                return
            except Exception as error:
                if recovering is not None and isinstance(error, _StateGone):
                    recovering.add_note(str(error))
                    raise recovering from None
                if not _errors.is_recoverable(error) or attempt > self.max_recoveries:
                    raise
                logger.warning("Retrying session creation after %r (attempt %d of %d).",
                               error, attempt, self.max_recoveries)

    def _restore_or_init(self, recovering: BaseException | None) -> tuple[Any, int]:
        """The state and its step: restored (its time the session's `restore`), else built
        fresh (its time `init`, with the look for a checkpoint that found none)."""
        with self._spent.timing("restore") as timing:
            restored = self._restore(recovering)
            self.rejected, self.data_rewound, self.windows = None, False, None
            if restored is not None:
                state, step = self._resume(restored, recovering), restored.step
            else:
                timing.category = "init"
                state, step = self._init_fn(), self._initial_step
                if self._warm_start is not None:
                    state, self.warm_start_report = _warm_start.warm_start(state, self._warm_start)
                state = unaliased(state, donated=self._donate_state)
            return (state if self._placement is not None else committed(state)), step

    def _restore(self, recovering: BaseException | None) -> _checkpoint.Restored | None:
        if self.checkpoint_dir is None or not _checkpoint.complete_steps(self.checkpoint_dir):
            return None
        if recovering is not None:
            for saver in _savers(self._hooks):  # a save in flight is the checkpoint to go back to
                saver.wait_until_finished()
        if self._like is None:
            self._like = (_restore_target(self._init_fn) if self._placement is None
                          else self._placement.like(_abstract_state(self._make_state,
                                                                    shardings=self._placement.keeps_shardings)))
        checkpoints = _checkpoint.Checkpoints(self.checkpoint_dir)
        try:
            return checkpoints.restore_latest(self._like)
        finally:
            checkpoints.close()

    def _resume(self, restored: _checkpoint.Restored, recovering: BaseException | None) -> Any:
        """Takes a restored checkpoint's data position and (at creation, not in a
        recovery, where hooks keep their own state as in TF) hook states; returns its
        state."""
        self.restored_step, self.windows = restored.step, restored.meta.get("windows")
        self._restored_config = restored.meta.get("config")
        position = _data_position(restored.meta, restored.step, self._batches.kind)
        self.data_rewound = self._batches.restore(position, restored.step, recovering is not None)
        if isinstance(recovering, _errors.RollbackError):
            self._skip_bad_batches(restored.step, recovering.step)
        if recovering is None:
            saved = restored.meta.get("hooks") or {}
            for (key, hook), legacy in zip(_hook_keys(self._hooks), _legacy_hook_keys(self._hooks), strict=True):
                if key in saved or legacy in saved:
                    _set_hook_state(hook, saved[key] if key in saved else saved[legacy])
        logger.info("Restored step %d from %s.", restored.step, self.checkpoint_dir)
        return restored.state

    def _skip_bad_batches(self, restored: int, bad: int) -> None:
        """After a roll-back to step `restored` for the bad step `bad`: the data moves past
        the batches of the steps after `restored` through `bad`, named in the log."""
        if bad <= restored:
            return
        if not self.data_rewound:
            logger.warning("Rolled back to step %d for the bad step %d. The data has no set_state(), so it goes on "
                           "from where it is, past the batch of step %d.", restored, bad, bad)
            return
        positions = self._batches.skip(bad - restored)
        shown = positions if len(positions) <= 4 else [*positions[:2], "...", positions[-1]]
        logger.warning("Rolled back to step %d for the bad step %d: the batches of steps %d to %d are skipped "
                       "(their data positions: %s).", restored, bad, restored + 1, bad,
                       ", ".join(json.dumps(position) if position != "..." else position for position in shown))

    def reject(self, reason: str) -> None:
        """Marks the current state, and every later one until the next `create`, as not
        fit to save; the first reason is kept."""
        if self.rejected is None:
            self.rejected = reason

    @property
    def new_config(self) -> bool:
        """Whether the session's config is news to its run: a fresh start, or a resume
        whose config differs from the one its checkpoint holds."""
        if self.restored_step is None:
            return True
        return json.dumps(self._config, sort_keys=True) != json.dumps(self._restored_config, sort_keys=True)

    def snapshot(self, state: Any, step: int, *, sync: Callable[[], None], peers: Any = None) -> Snapshot | None:
        """What a checkpoint of `state` at `step` holds, or None (logged) when it must
        not be saved. `sync()` delivers the late hooks first (a NaN check may reject
        the state), and every summary writer is flushed: the records of every step up
        to `step` are on disk before the checkpoint is. With several processes
        (`peers`, the session's `AgreedRuns`), every process saves or none does, a late
        hook's error is raised once every process knows, and the checkpoint keeps every
        process's data position (each reads its own shard) as `data_by_process`."""
        agree_all = bool if peers is None else peers.all
        error = None
        try:
            sync()
        except Exception as raised:
            error = raised
        if not agree_all(error is None and self.rejected is None):
            if error is not None:
                raise error
            logger.warning("Not saving a checkpoint of step %d: %s.", step,
                           self.rejected or "another JAX process cannot save it")
            return None
        info = self.resume_info(step)
        if peers is not None:
            info["data_by_process"] = peers.gather(info["data"])
        _writers.flush_all()  # once the checkpoint is complete, every record of its steps is on disk
        return Snapshot(step, state, info)

    def resume_info(self, step: int) -> dict[str, Any]:
        """The metadata a checkpoint of `step` holds (see `MonitoredSession.resume_info`)."""
        hooks = {}
        for key, hook in _hook_keys(self._hooks):
            state = _hook_state(hook)
            if state is not None:
                hooks[key] = state
        info = {
            **_checkpoint.versions(),
            "step": step,
            "data": self._batches.position(),
            "hooks": hooks,
            "windows": self._accumulators.get_state(step),
            "config": self._config,
        }
        return _checkpoint.check_json(info, "the checkpoint metadata (data get_state() and hooks' get_state())")


def _data_position(meta: dict[str, Any], step: int, kind: str) -> Any:
    """This process's data position in a checkpoint's `meta`: its own entry of
    `data_by_process` (saved with several processes), else `data` (the chief's). On
    another number of processes, one position of every process that counts global
    batches (it has `global_batch`: `jm.ArrayDataSource(shard=...)`, `jaxmon train`'s
    loaders) resumes exactly; other positions are not re-split: each process takes the
    chief's, and a warning says so, naming the data (`kind`)."""
    positions = meta.get("data_by_process")
    if positions is None:
        return meta.get("data")
    if len(positions) == jax.process_count():
        return positions[jax.process_index()]
    first = positions[0]
    if isinstance(first, dict) and "global_batch" in first and all(p == first for p in positions):
        return first  # one global position: its batches split over any count
    logger.warning("Checkpoint %d was saved by %d JAX processes, this run has %d, and its data (a %s) has no global "
                   "position: every process restarts from the chief's, so the global batches are not the interrupted "
                   "run's. jm.ArrayDataSource(shard='process') keeps one, which resumes on any number of processes.",
                   step, len(positions), jax.process_count(), kind)
    return meta.get("data")


def unaliased(state: Any, donated: bool = True) -> Any:
    """`state` with a copy of every leaf that shares its buffer with an earlier leaf
    (TF's moving-average idiom `extras={"avg": params}`), noticed in one line: a step
    that takes the state's buffers (donation) cannot take one twice. A state that is not
    donated (`donated=False`) is returned as it is: reading one buffer twice is fine."""
    if not donated:
        return state
    seen: dict[int, str] = {}
    copied = []

    def leaf(path, x):
        if not isinstance(x, jax.Array) or x.is_deleted():
            return x
        pointers = [shard.data.unsafe_buffer_pointer() for shard in x.addressable_shards]
        name = f"state{jax.tree_util.keystr(path)}"
        first = next((seen[p] for p in pointers if p in seen), None)
        if first is not None:
            copied.append((name, first))
            x = x.copy()
            pointers = [shard.data.unsafe_buffer_pointer() for shard in x.addressable_shards]
        seen.update(dict.fromkeys(pointers, name))
        return x

    state = jax.tree_util.tree_map_with_path(leaf, state)
    if copied:
        pairs = ", ".join(f"{name} (the buffer of {first})" for name, first in copied)
        logger.warning("Copied %d state leaves that share a buffer with another: %s. The step is given the "
                       "state's buffers to reuse (donate_state=True), and one buffer cannot be given twice; give "
                       "each leaf its own array (jnp.copy), or pass donate_state=False, to skip this copy.",
                       len(copied), pairs)
    return state


def committed(state: Any) -> Any:
    """`state` with every leaf a strongly typed array committed to one device, as the
    leaves of a restored state are: a fresh and a restored state then run the same
    compiled program (found in the persistent compilation cache at a restart) and
    promote dtypes alike. Committing an array on its own device copies nothing. A state
    with leaves placed on several devices by hand is left as it is."""
    arrays = [x for x in jax.tree.leaves(state) if isinstance(x, jax.Array)]
    devices = {d for x in arrays if x.committed for d in x.sharding.device_set}
    if len(devices) > 1:
        return state
    # the device the committed leaves are on, else the one the others are on (jax.default_device's)
    device = devices.pop() if devices else next(iter(arrays[0].devices())) if arrays else jax.devices()[0]

    def leaf(x: Any) -> Any:
        weak = jax.typeof(x).weak_type
        if isinstance(x, jax.Array) and x.committed and not weak:
            return x
        return jax.device_put(np.asarray(x) if weak or not isinstance(x, jax.Array) else x, device)

    return jax.tree.map(leaf, state)


def _restore_target(init_fn: Callable[[], Any]) -> Any:
    """The shapes, dtypes and shardings of the state `init_fn` builds, to restore into."""
    return _checkpoint.abstract_like(_abstract_state(init_fn))


def _abstract_state(init_fn: Callable[[], Any], shardings: bool = True) -> Any:
    """The state `init_fn` builds, as shapes, dtypes and (with `shardings`) shardings
    where tracing it tells them all, else built for real, once.

    `jax.eval_shape` builds nothing, but it loses shardings that `init_fn` sets with
    `jax.device_put` (those of a jitted `init_fn` with `out_shardings` survive), and it
    cannot trace an `init_fn` that must run outside of `jit` (one that enters
    `jax.set_mesh`, say): then `init_fn` runs as on a fresh start."""
    try:
        abstract = jax.eval_shape(init_fn)
    except Exception as error:  # noqa: BLE001 - any failure to trace: running it is the fallback
        logger.info("To restore a checkpoint, init_fn is traced (jax.eval_shape) for the state's shapes; that "
                    "failed (%s: %s), so it runs once instead, as on a fresh start.",
                    type(error).__name__, str(error).splitlines()[0][:200] if str(error) else "")
        return init_fn()
    if shardings and jax.device_count() > 1 and any(getattr(leaf, "sharding", None) is None
                                                    for leaf in jax.tree.leaves(abstract)):
        return init_fn()
    return abstract


def _savers(hooks: tuple[Hook, ...]) -> list[Saver]:
    """The hooks that write checkpoints (the `Saver` protocol), in list order."""
    return [hook for hook in hooks if getattr(hook, "checkpoint_dir", None) is not None
            and callable(getattr(hook, "wait_until_finished", None))]


def _hook_state(hook: Hook) -> dict[str, Any] | None:
    """`hook.get_state()`; for an older hook that relied on `Hook.get_state` saving its
    `timer` (deprecated), that timer's last trigger."""
    state = hook.get_state()
    timer = getattr(hook, "timer", None)
    if state is None and type(hook).get_state is Hook.get_state and isinstance(timer, SecondOrStepTimer):
        state = {"timer": timer.get_state()}
    return state


def _set_hook_state(hook: Hook, state: dict[str, Any]) -> None:
    timer = getattr(hook, "timer", None)
    if type(hook).set_state is Hook.set_state and isinstance(timer, SecondOrStepTimer) and "timer" in state:
        timer.set_state(state["timer"])
    hook.set_state(state)


def _hook_keys(hooks: tuple[Hook, ...]) -> list[tuple[str, Hook]]:
    """Keys for the hooks' saved states: the class name and which of that class's
    hooks it is ("StopAtStepHook", "EvalHook#2"). Hooks of other classes added or
    removed between runs (a chief's standard hooks, a changed setting) shift no key."""
    seen: dict[str, int] = {}
    keys = []
    for hook in hooks:
        name = type(hook).__name__
        seen[name] = seen.get(name, 0) + 1
        keys.append((name if seen[name] == 1 else f"{name}#{seen[name]}", hook))
    return keys


def _legacy_hook_keys(hooks: tuple[Hook, ...]) -> list[str]:
    """The keys of checkpoints written before `_hook_keys`: position and class name."""
    return [f"{i}:{type(hook).__name__}" for i, hook in enumerate(hooks)]


class _StateGone(RuntimeError):
    """The state given with `state=` was donated and cannot be re-created."""


def _once(state: Any) -> Callable[[], Any]:
    used = False

    def init_fn() -> Any:
        nonlocal used
        if used:
            raise _StateGone(
                "The session cannot re-create a state given with state=: pass init_fn= "
                "(a function returning the initial state) to recover from this error."
            )
        used = True
        return state

    return init_fn
