"""CheckpointSaverHook and its listeners: TF's save points on Orbax's async saves."""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from jaxmon._base.errors import check_int
from jaxmon._base.hook import RunContext, RunValues
from jaxmon._base.timed import TimedHook
from jaxmon._base.triggers import Trigger, timer_for
from jaxmon._checkpoints import manager as _checkpoint

logger = logging.getLogger("jaxmon")


class CheckpointSaverListener:
    """Called around the saves of a `CheckpointSaverHook` (TF's listener).

    `after_save` returning True asks the loop to stop. Saves are asynchronous: at
    `after_save` the state is copied off the device and being written; the files
    are complete once the next save starts or the session closes.

    Example:
      >>> import jaxmon as jm
      >>> class Announce(jm.CheckpointSaverListener):
      ...     def after_save(self, session, step):
      ...         print("saved", step)
    """

    def begin(self) -> None:
        """Called once, in the hook's `begin`."""

    def before_save(self, session, step: int) -> None:
        """Called before each save of `step`."""

    def after_save(self, session, step: int) -> bool | None:
        """Called after each save of `step`; return True to stop training."""

    def end(self, session, step: int) -> None:
        """Called once at the hook's `end`, after its final save."""


class CheckpointSaverHook(TimedHook):
    """Saves the state with Orbax at TF's save points: at session creation, after steps
    N, 2N, ... for `save_steps=N` (a resumed run, even one stopped by SIGTERM or
    Ctrl-C at another step, keeps that schedule) or every `save_secs` seconds (a
    checkpoint keeps how long its timer has waited), on preemption (SIGTERM), and at
    `end` if the last step was not saved.

    Each checkpoint holds the state, the step, the data iterator's position (when it
    has `get_state()`), the hooks' own state and metadata, which is everything an exact
    resume needs (see `MonitoredSession`). Saving is asynchronous: the loop waits only
    while the state is copied off the device; the files are written in the background
    and committed atomically. A save that fails there (a full disk) raises its
    `SaveError` from the session's next run once the failure is known, so that no
    more steps are trained that could not be saved. Before each save the session's late hooks are delivered
    (`sess.sync()`), so a NaN check has passed on every state that is saved. A save
    happens once every hook's `after_run` of its step is done (`session.after_hooks`),
    so a checkpoint of step N holds every hook's state after step N, wherever the saver
    sits in the hook list.

    Args:
      checkpoint_dir: where to save; the session restores from it too (unless given its
        own `checkpoint_dir`). One run writes one directory at a time.
      save_secs, save_steps: the period; exactly one.
      listeners: `CheckpointSaverListener`s.
      max_to_keep: how many of the latest checkpoints to keep (None: all).
      keep_period: also keep every checkpoint whose step is a multiple of this.
      keep_best: also keep this many best checkpoints by `best_metric`. The latest
        checkpoint is never deleted, however bad its metric.
      best_metric: the metric ranking checkpoints: an output name (its value at the
        saved step) or a function `fn(session) -> float`, asked once every hook has
        seen the saved step (an `EvalHook` anywhere in the list has evaluated it). It
        may return None or an infinity before its first value: that checkpoint is
        kept only while it is among the latest.
      best_mode: "min" or "max".
      async_save: write in the background (default) or block until written.
      integrity: record the size and CRC-32 of each checkpoint's files as it commits
        (default), so that a restore refuses one whose bytes changed since and uses
        the one before it. False saves one read of the checkpoint per save (about
        50 ms per 100 MB); those checkpoints restore unchecked.
      clock: an injectable time function (tests pass a fake).

    Example:
      >>> import jaxmon as jm
      >>> hook = jm.CheckpointSaverHook("runs/train", save_steps=1000, max_to_keep=3)
    """

    time_category = "checkpoint"  # where its time goes in the session's goodput (`jm.GoodputHook`)


    def __init__(self, checkpoint_dir: str | os.PathLike, save_secs: float | None = None,
                 save_steps: int | None = None, listeners: Iterable[CheckpointSaverListener] = (), *,
                 max_to_keep: int | None = 5, keep_period: int | None = None, keep_best: int | None = None,
                 best_metric: str | Callable[[Any], float] | None = None, best_mode: str = "min",
                 async_save: bool = True, integrity: bool = True, clock: Callable[[], float] = time.monotonic):
        if not isinstance(checkpoint_dir, (str, os.PathLike)) or not os.fspath(checkpoint_dir):
            raise ValueError(f"CheckpointSaverHook checkpoint_dir must be a directory path; got {checkpoint_dir!r}.")
        self.timer = timer_for("CheckpointSaverHook", clock, save_steps=save_steps, save_secs=save_secs)
        self.listeners = tuple(listeners)
        for listener in self.listeners:
            if not isinstance(listener, CheckpointSaverListener):
                raise TypeError(f"CheckpointSaverHook listeners must be CheckpointSaverListener instances; "
                                f"got {listener!r}.")
        for name, value in (("max_to_keep", max_to_keep), ("keep_period", keep_period), ("keep_best", keep_best)):
            if value is not None:
                check_int(f"CheckpointSaverHook {name}", value, minimum=1)
        if best_mode not in ("min", "max"):
            raise ValueError(f"CheckpointSaverHook best_mode must be 'min' or 'max'; got {best_mode!r}.")
        if (keep_best is None) != (best_metric is None):
            raise ValueError(f"CheckpointSaverHook keep_best and best_metric go together; got keep_best="
                             f"{keep_best!r}, best_metric={best_metric!r}.")
        if best_metric is not None and not (isinstance(best_metric, str) or callable(best_metric)):
            raise TypeError(f"CheckpointSaverHook best_metric must be an output name or fn(session) -> float; "
                            f"got {best_metric!r}.")
        self.checkpoint_dir = os.fspath(checkpoint_dir)
        self.async_save = async_save
        self._options = dict(async_save=async_save, max_to_keep=max_to_keep, keep_period=keep_period,
                             keep_best=keep_best, best_mode=best_mode, integrity=integrity)
        self.best_metric = best_metric
        self._checkpoints: _checkpoint.Checkpoints | None = None
        self._grace: float | None = None
        self._session = None
        self.saved_steps: list[int] = []

    def next_trigger(self, step: int) -> Trigger | None:
        if self._session is not None and self._session.preemption_requested:
            return None  # a preemption: save at the next run
        return self.timer.next_trigger(step)

    def begin(self) -> None:
        self.timer.reset()
        self.saved_steps = []
        for listener in self.listeners:
            listener.begin()
        if self._checkpoints is None:
            self._checkpoints = _checkpoint.Checkpoints(self.checkpoint_dir, writer=True, **self._options)

    # Each save waits until every hook has seen its step (`session.after_hooks`): a
    # checkpoint of step N holds every hook's state after step N, whatever the order.

    def after_create_session(self, session) -> None:
        self._grace, self._session = session.stop_grace_period_secs, session
        step = session.step
        self.timer.start(step)
        if step not in self._checkpoints.steps():  # a restored step is already saved
            session.after_hooks(lambda: self._save(session, step))

    def after_run(self, ctx: RunContext, values: RunValues) -> None:
        session = ctx.session
        preempted = session.preemption_requested
        if not (preempted or self.timer.should_trigger_for_step(values.step)):
            return
        self.timer.update_last_triggered_step(values.step)
        session.after_hooks(lambda: self._save_after_run(ctx, values.step, preempted))

    def _save_after_run(self, ctx: RunContext, step: int, preempted: bool) -> None:
        if self._save(ctx.session, step):
            ctx.request_stop()
        if preempted:
            self.wait_until_finished()
            logger.warning("Preempted: saved step %d to %s; stopping.", step, self.checkpoint_dir)

    def end(self, session) -> None:
        session.after_hooks(lambda: self._save_at_end(session))

    def _save_at_end(self, session) -> None:
        step = session.step
        if step != self.timer.last_triggered_step():
            self.timer.update_last_triggered_step(step)
            self._save(session, step)
        for listener in self.listeners:
            listener.end(session, step)

    def close(self) -> None:
        checkpoints, self._checkpoints = self._checkpoints, None
        if checkpoints is not None:
            # With a peer process gone, a save in flight can never commit: do not wait for it.
            lost = self._session is not None and getattr(self._session, "peer_lost", False)
            checkpoints.close(timeout=1.0 if lost else self._grace)

    def wait_until_finished(self) -> None:
        """Blocks until the save in flight is written (bounded by the session's
        `stop_grace_period_secs`), raising its error if it failed."""
        if self._checkpoints is not None:
            self._checkpoints.wait(self._grace)

    wait = wait_until_finished

    def _save(self, session, step: int) -> bool:
        """Saves `step` (unless the session says its state must not be saved); returns
        whether a listener asked to stop."""
        snapshot = session.snapshot()
        if snapshot is None:
            return False
        for listener in self.listeners:
            listener.before_save(session, step)
        self._checkpoints.save(step, snapshot.state, snapshot.meta, best=self._best(session, step))
        self.saved_steps.append(step)
        logger.info("Saving checkpoint %d to %s.", step, self.checkpoint_dir)
        stop = False
        for listener in self.listeners:
            stop |= bool(listener.after_save(session, step))
        if stop:
            logger.info("A CheckpointSaverListener asked to stop after saving step %d.", step)
        return stop

    def _best(self, session, step: int) -> float | None:
        if self.best_metric is None:
            return None
        if callable(self.best_metric):
            value = self.best_metric(session)
        else:  # None before the first run (the save at creation): kept as the latest only
            value = session.last_outputs.get(self.best_metric)
        if value is None:
            return None
        value = float(np.asarray(value))
        if math.isnan(value):
            raise ValueError(f"CheckpointSaverHook best_metric {self.best_metric!r} is nan at step {step}; "
                             "it must be a number to rank checkpoints (None or an infinity before its first value).")
        return None if math.isinf(value) else value  # no value yet: kept as the latest only

    def __repr__(self) -> str:
        return f"CheckpointSaverHook({self.checkpoint_dir!r}, {self.timer!r})"
