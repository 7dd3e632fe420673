"""MonitoredSession: the hooked, recoverable training loop around one compiled step."""

from __future__ import annotations

import collections
import itertools
import logging
import os
import signal
import threading
from collections.abc import Callable, Iterable, Mapping
from typing import Any, NamedTuple

import jax
import numpy as np
from jax.experimental import multihost_utils

from jaxmon import _agree, _checkpoint, _errors, _fetches, _sharding
from jaxmon._hook import Hook, RunArgs, RunContext, RunValues
from jaxmon._step import CompiledStep

logger = logging.getLogger("jaxmon")


class MonitoredSession:
    """Runs a step function with hooks: TF 1.x's `MonitoredSession`, made for JAX.

    The state (any pytree) flows through `step_fn(state, batch) -> (new_state,
    outputs)`, which the session jits (state donated by default). Each `run()` calls
    every hook's `before_run`, dispatches ONE compiled step that also computes every
    value the hooks and the caller fetched, then calls every `after_run`. A run in
    which nobody fetches anything never waits for the device.

    Args:
      step_fn: `step_fn(state, batch) -> (new_state, outputs)`, pure and jittable;
        `outputs` is a dict of arrays (loss, metrics). Do not jit it yourself.
      init_fn: `init_fn() -> state`, called at creation and to re-create the state
        after a recoverable error. Give exactly one of `init_fn` and `state`.
      state: the initial state itself (it is donated to the first step).
      data: an iterable of batches; `run()` without a batch takes the next one, and
        its end ends the session cleanly.
      hooks: `Hook` instances, called in list order.
      donate_state: donate the state's buffers to the step (saves memory; the arrays
        of a previous state are then deleted).
      initial_step: the step number the initial state has completed, for a state
        restored by hand (0 for a fresh one).
      max_recoveries: how many times one `run()` (or the session's creation)
        re-creates the state and retries after `AbortedError`/`UnavailableError`
        before the error propagates. TF retried forever; a bound ends a loop that
        would never succeed.
      checkpoint_dir: restore the latest checkpoint found here at creation and after a
        recoverable error (the state, the step, the data position and the hooks' own
        state), else call `init_fn`. Default: the directory of a
        `CheckpointSaverHook` among `hooks`. A broken latest checkpoint is reported
        and the one before it is used; a directory whose checkpoints all fail raises.
      warm_start: on the fresh-init path only: a checkpoint (a run's directory or one
        step's directory) whose leaves replace those of the fresh state where path,
        shape and dtype match (`warm_start_report` says which), or a function
        `state -> state`. In a state with `params` (e.g. `jm.TrainState`) the
        optimizer state, step counter and RNG (`opt_state`, `step`, `rng`) start
        fresh, as in TF's warm start; every other leaf is taken where it matches.
      config: a JSON-serialisable dict saved in every checkpoint's metadata.
      stop_grace_period_secs: the longest `close()` (and a save on SIGTERM) may wait
        for pending checkpoint writes.
      handle_sigterm: on SIGTERM, stop at the next step boundary, after a
        `CheckpointSaverHook` saved that step (a second SIGTERM kills as usual).
        Needs the session to be built in the main thread. With several JAX
        processes, JAX's preemption service handles SIGTERM instead, and every
        process stops at the step it agreed on (`jax_enable_preemption_service`).
      mesh: a `jax.sharding.Mesh`: the state is placed on it with `state_sharding` and
        kept there (the compiled step constrains the new state to it; donation still
        applies), and each batch is assembled into a global array with
        `batch_sharding` from this process's part of it
        (`jax.make_array_from_process_local_data`; with one process, the part is the
        whole batch). Checkpoints restore onto the current mesh, whatever the device
        count was when they were saved.
      state_sharding: None (replicated), a `PartitionSpec` for every leaf, a pytree of
        them that is a prefix of the state (`{"params": P(), "opt": P()}`), or a
        function `abstract_state -> such a pytree`.
      batch_sharding: the same for batches; None shards the leading axis of every
        batch array over all the mesh's axes (data parallelism) and replicates
        scalars. Fetched values must be replicated when several processes share the
        mesh (a loss and metrics are): each process reads its own copy.
      steps_per_dispatch: run up to this many steps per `run()` in one dispatch
        (`jax.lax.scan` over that many batches from `data`, or over a list of batches
        given to `run()`), cutting runs short so that every step-based trigger (a
        hook's `steps_to_next_trigger`: summaries, checkpoints, evaluations, the last
        step) still ends a run on its exact step. Run lengths are powers of two, so at
        most log2(k) + 1 programs compile per fetch set. Hooks see one `before_run` /
        `after_run` per run (`ctx.steps` steps), with the last step's outputs, as TF's
        `steps_per_run`. Seconds-based triggers fire at run ends. One process, no mesh.
      max_dispatch_ahead: at most this many steps queued without waiting for one (the
        run that would queue one more first waits for the oldest). "auto": 16 when
        several CPU devices run the step (XLA aborts when ~50 programs with
        collectives queue up on simulated CPU devices), else no bound; None: no
        bound.

    Example:
      >>> import jax.numpy as jnp, jaxmon as jm
      >>> def step_fn(state, batch):
      ...     state = state + batch
      ...     return state, {"total": state}
      >>> with jm.MonitoredSession(step_fn, state=jnp.zeros(()), data=[1.0, 2.0, 3.0],
      ...                          hooks=[jm.StopAtStepHook(last_step=2)]) as sess:
      ...     while not sess.should_stop():
      ...         values = sess.run(fetches=["total"])
      >>> sess.step, float(values["total"])
      (2, 3.0)
    """

    def __init__(
        self,
        step_fn: Callable[[Any, Any], tuple[Any, Mapping[str, Any]]],
        init_fn: Callable[[], Any] | None = None,
        *,
        state: Any = None,
        data: Iterable[Any] | None = None,
        hooks: Iterable[Hook] = (),
        donate_state: bool = True,
        initial_step: int = 0,
        max_recoveries: int = 10,
        checkpoint_dir: str | os.PathLike | None = None,
        warm_start: str | os.PathLike | Callable[[Any], Any] | None = None,
        config: Mapping[str, Any] | None = None,
        stop_grace_period_secs: float = 120,
        handle_sigterm: bool = True,
        mesh: jax.sharding.Mesh | None = None,
        state_sharding: Any = None,
        batch_sharding: Any = None,
        max_dispatch_ahead: int | None | str = "auto",
        steps_per_dispatch: int = 1,
    ):
        if (init_fn is None) == (state is None):
            raise ValueError(
                "MonitoredSession needs exactly one of init_fn= (a function returning the "
                f"initial state) or state= (the state itself); got init_fn={init_fn!r} and "
                f"state={'None' if state is None else type(state).__name__}."
            )
        if init_fn is not None and not callable(init_fn):
            raise TypeError(
                f"init_fn must be a function init_fn() -> state; got a value of type {type(init_fn).__name__}. "
                "To pass the state itself, use state=: MonitoredSession(step_fn, state=state)."
            )
        _errors.check_int("initial_step", initial_step)
        _errors.check_int("max_recoveries", max_recoveries)
        _errors.check_number("stop_grace_period_secs", stop_grace_period_secs)
        if warm_start is not None and not (callable(warm_start) or isinstance(warm_start, (str, os.PathLike))):
            raise TypeError(f"warm_start must be a checkpoint path or a function state -> state; got {warm_start!r}.")
        if mesh is None and (state_sharding is not None or batch_sharding is not None):
            raise ValueError("state_sharding= and batch_sharding= need mesh= (a jax.sharding.Mesh), e.g. "
                             f"mesh=jax.make_mesh(({jax.device_count()},), ('data',)).")
        self._placement = None if mesh is None else _sharding.Placement(mesh, state_sharding, batch_sharding)
        if max_dispatch_ahead == "auto":
            max_dispatch_ahead = _sharding.dispatch_ahead_default(self._placement)
        if max_dispatch_ahead is not None:
            _errors.check_int("max_dispatch_ahead", max_dispatch_ahead, minimum=1)
        self.max_dispatch_ahead = max_dispatch_ahead
        _errors.check_int("steps_per_dispatch", steps_per_dispatch, minimum=1)
        if steps_per_dispatch > 1 and (mesh is not None or jax.process_count() > 1):
            raise ValueError(f"steps_per_dispatch={steps_per_dispatch} works on one process without mesh= for now; "
                             "use steps_per_dispatch=1 with a mesh or several processes.")
        self.steps_per_dispatch = steps_per_dispatch
        self._buffer: collections.deque = collections.deque()  # (batch, data position before it) taken ahead
        self._last_length = 1
        self._in_flight: collections.deque = collections.deque()
        self._compiled = CompiledStep(step_fn, donate_state=donate_state)
        self._hooks = _check_hooks(() if hooks is None else hooks)
        self._init_fn = init_fn if init_fn is not None else _once(state)
        self._make_state = self._init_fn
        if self._placement is not None:
            self._init_fn = lambda make=self._make_state, place=self._placement.place_state: place(make())
        self._like = None if state is None or self._placement is not None else _checkpoint.abstract_like(state)
        self._checkpoint_dir = os.fspath(checkpoint_dir) if checkpoint_dir is not None else next(
            (hook.checkpoint_dir for hook in self._hooks if hook.checkpoint_dir is not None), None)
        self._warm_start = warm_start
        self.warm_start_report: _checkpoint.WarmStartReport | None = None
        self._config = None if config is None else _checkpoint.check_json(dict(config), "config")
        self._data = None if data is None else iter(data)
        self._initial_step = initial_step
        self._max_recoveries = max_recoveries
        self.stop_grace_period_secs = stop_grace_period_secs
        self._stop_requested = False
        self._closed = False
        self._state: Any = None
        self._step = initial_step
        self._last_run: tuple[Any, Any] = (None, {})
        self._late: collections.deque = collections.deque()
        self._hook_failures: dict[int, int] = {}
        self._preempted = False
        self._rejected: str | None = None
        #: True once another JAX process of the run stopped answering.
        self.peer_lost = False
        #: The step of the checkpoint this session was created from (None: a fresh start).
        self.restored_step: int | None = None
        self._data_rewound = False
        # Several JAX processes must stop at one step: JAX's preemption service takes
        # SIGTERM and names the step (polled in run()); one process handles it itself.
        self._sync_preemption = jax.process_count() > 1
        self._agreement = _agree.Agreement() if jax.process_count() > 1 else None
        self._agreed_stop = self._data_ended = False
        if self._agreement is not None:  # seconds-based triggers read the chief's clock, agreed each run
            for hook in self._hooks:
                if hook.timer is not None:
                    hook.timer.use_clock(self._agreement.clock)
        self._sigterm = _SigtermHandler(self) if handle_sigterm and not self._sync_preemption else None
        try:
            for hook in self._hooks:
                try:
                    hook.begin()
                except Exception as error:
                    self._hook_failed(hook, "begin", initial_step, error)
            self._create_state()
        except BaseException:
            self._closed = True
            self._close_hooks(raise_errors=False)  # release what begin() opened
            raise

    # -- the loop -------------------------------------------------------------------

    def run(self, batch: Any = None, *, fetches: Any = None) -> Any:
        """Runs one step with every hook; returns its outputs or the caller's fetches.

        Args:
          batch: the step's batch; None takes the next item of `data`.
          fetches: values to return as host NumPy (see `RunArgs.fetches`).

        Returns:
          The step's `outputs` as device arrays (no host sync) when `fetches` is None,
          else a dict of host values for the fetches.

        Raises:
          RuntimeError: the session was asked to stop, or is closed.
          StopIteration: `data` (or a hook) ended; inside `with`, the block ends cleanly.
        """
        if self._closed:
            raise RuntimeError("Run called on a closed session. Create a new session to train further.")
        if self._stop_requested if self._agreement is None else self._agreed_stop:
            raise RuntimeError(
                "Run called even after should_stop requested. Check sess.should_stop() "
                "before each run (`while not sess.should_stop(): sess.run()`)."
            )
        wanted = _fetches.normalize(fetches, "run(fetches=...)")
        if self._agreement is not None:
            return self._run_agreed(batch, fetches, wanted)
        from_data = take_from_data = batch is None and self._data is not None
        try:
            for attempt in itertools.count(1):
                try:
                    if take_from_data:
                        batch, take_from_data = self._next_batch(), False
                    return self._run_hooked(batch, fetches, wanted)
                except Exception as error:
                    if not _errors.is_recoverable(error) or attempt > self._max_recoveries:
                        raise
                    logger.warning("Recovering from %r (attempt %d of %d): re-creating the state.",
                                   error, attempt, self._max_recoveries)
                    self._create_state(recovering=error)
                    # A batch in hand is past the restored data position: take the next one.
                    take_from_data = take_from_data or (from_data and self._data_rewound)
        except StopIteration:
            self._stop_requested = True  # end of data: a clean stop
            raise

    def _next_batch(self) -> Any:
        """The next batch from `data`; with `steps_per_dispatch`, a `_Steps` of as many
        as the next trigger allows (a power of two), stacked."""
        if self.steps_per_dispatch == 1:
            return next(self._data)
        length = self._run_length()
        get_state = getattr(self._data, "get_state", None)
        while len(self._buffer) < length:
            position = get_state() if callable(get_state) else None
            try:
                self._buffer.append((next(self._data), position))
            except StopIteration:
                if not self._buffer:
                    raise
                length = 1 << (len(self._buffer).bit_length() - 1)  # what is left, in powers of two
        items = [self._buffer.popleft()[0] for _ in range(length)]
        return items[0] if length == 1 else _Steps(items)

    def _run_length(self) -> int:
        """The most steps the next run may take: `steps_per_dispatch`, cut to the next
        step some hook must end a run on, rounded down to a power of two."""
        limit = self.steps_per_dispatch
        for hook in self._hooks:
            steps = hook.steps_to_next_trigger(self._step)
            if steps is not None:
                limit = min(limit, steps)
        return 1 << (max(1, limit).bit_length() - 1)

    def _run_hooked(self, batch: Any, fetches: Any, wanted: dict | None) -> Any:
        length = 1
        if isinstance(batch, list) and self.steps_per_dispatch > 1:
            batch = _Steps(batch)
        if isinstance(batch, _Steps):
            length, batch = len(batch.items), batch.stacked()
        ctx = RunContext(self._step, self, RunArgs(fetches, batch), steps=length)
        now: list[list] = []  # [hook, results] of the hooks whose after_run follows this run, in order
        late: list[list] = []  # ... and of those asking for late delivery
        asking: list[tuple[list, RunArgs]] = []  # those fetching or feeding
        for hook in self._hooks:
            try:
                args = hook.before_run(ctx)
                if args is not None:
                    args = _check_run_args(args, hook)
            except Exception as error:
                self._hook_failed(hook, "before_run", ctx.step, error)  # a warn-policy hook sits out
                continue
            entry = [hook, None]
            if args is None:
                now.append(entry)
                continue
            (late if args.late else now).append(entry)
            if args.fetches is not None or args.feeds:
                asking.append((entry, args))
        plan, fetching = _NOTHING_FETCHED, []
        if asking:
            feeds = [(entry[0], args.feeds) for entry, args in asking if args.feeds]
            if length > 1:  # one value for every step of the run
                feeds = [(hook, {k: np.broadcast_to(np.asarray(v), (length, *np.shape(v))) for k, v in f.items()})
                         for hook, f in feeds]
            batch = _merge_feeds(batch, feeds)
            fetching = [(entry, _fetches.normalize(args.fetches, entry[0]))
                        for entry, args in asking if args.fetches is not None]
            if fetching:
                plan = _fetches.FetchPlan([("run(fetches=...)", wanted)] + [(e[0], spec) for e, spec in fetching])
        elif wanted is not None:
            plan = _fetches.FetchPlan([("run(fetches=...)", wanted)])
        if self._placement is not None:
            batch = self._placement.place_batch(batch)
        self._state, outputs, fetched = self._compiled(plan.key, self._state, batch, plan.owners, length)
        if self.max_dispatch_ahead is not None:
            self._bound_dispatch(outputs)
        self._step += length
        self._last_run, self._last_length = (batch, outputs), length
        if self._sync_preemption:
            self._poll_preemption()
        if self._preempted:
            self._stop_requested = True
        caller, *results = plan.route(outputs, fetched)
        for (entry, _), hook_results in zip(fetching, results, strict=True):
            entry[1] = hook_results
        self._deliver_late()  # the previous run's: the device already has this one queued
        if late:
            self._late.append((ctx, self._step, outputs, late))
        if caller is not None or (fetching and any(entry[1] is not None for entry in now)):
            caller, host = _to_host((caller, [entry[1] for entry in now]))
            for entry, hook_results in zip(now, host, strict=True):
                entry[1] = hook_results
        self._call_after_run(ctx, self._step, outputs, now)
        return outputs if caller is None else caller

    def _run_agreed(self, batch: Any, fetches: Any, wanted: dict | None) -> Any:
        """A run when several JAX processes share the step: after it, every process
        learns whether any of them asked to stop, ran out of data or failed in a hook,
        and all act on it at this same step (see `_agree`). The next batch is taken
        before agreeing, so that the end of one process's data stops all of them."""
        from_data = batch is None and self._data is not None
        if from_data:
            batch = self._buffer.popleft()[0] if self._buffer else next(self._data)
        before, error, result = self._step, None, None
        try:
            result = self._run_hooked(batch, fetches, wanted)
        except Exception as raised:
            if self._step == before:  # the step never ran here: the others wait in it for this process
                raise
            error = raised  # after the step (a hook's after_run, e.g. a NaN): raised once all agree
        if from_data:
            position = self._data.get_state() if callable(getattr(self._data, "get_state", None)) else None
            try:
                self._buffer.append((next(self._data), position))
            except StopIteration:
                self._data_ended = True
        try:
            decision = self._agreement(self._step, stop=self._stop_requested or self._data_ended, error=error)
        except _agree.PeerError as lost:
            self._lost_peer(lost)
            raise
        if decision.failure is not None:
            if error is not None:
                raise error
            process, message = decision.failure
            raise _agree.PeerError(f"JAX process {process} failed after step {self._step}: {message}. "
                                   f"Every process of the run stops at this step.")
        if decision.stop and not self._agreed_stop:
            self._agreed_stop = True
            if len(decision.stopped_by) < self._agreement.process_count:  # not a stop all of them took
                logger.info("Process(es) %s asked to stop (or ran out of data) at step %d: every process "
                            "stops.", list(decision.stopped_by), self._step)
        return result

    def _bound_dispatch(self, outputs: Any) -> None:
        """Waits for the step `max_dispatch_ahead` runs back, so that no more than that
        many steps are ever queued on the device."""
        marker = next(iter(jax.tree.leaves(outputs)), None)
        if marker is None:  # nothing to wait on but the state, which the next run donates
            if (self._step + 1) % self.max_dispatch_ahead == 0:
                jax.block_until_ready(self._state)
            return
        self._in_flight.append(marker)
        if len(self._in_flight) > self.max_dispatch_ahead:
            self._in_flight.popleft().block_until_ready()

    def _call_after_run(self, ctx: RunContext, step: int, outputs: Any, entries: list[list]) -> None:
        plain = RunValues(None, step, outputs)
        for hook, results in entries:
            try:
                hook.after_run(ctx, plain if results is None else RunValues(results, step, outputs))
            except Exception as error:
                self._hook_failed(hook, "after_run", step, error)
        self._stop_requested |= ctx.stop_requested

    def _deliver_late(self) -> None:
        """Calls the `after_run` of every run whose hooks asked for late delivery."""
        while self._late:
            ctx, step, outputs, entries = self._late.popleft()
            if any(entry[1] is not None for entry in entries):
                host = _to_host([entry[1] for entry in entries])
                entries = [[entry[0], r] for entry, r in zip(entries, host, strict=True)]
            self._call_after_run(ctx, step, outputs, entries)

    def sync(self) -> None:
        """Delivers every pending late `after_run` now (see `RunArgs.late`).

        After it, every hook has seen every completed run: NaN checks and stop
        requests of the last run have happened. It waits for the device only as long
        as reading those values needs. Checkpoint saves call it first, so that a
        checkpoint never holds a state that a hook would have rejected.
        """
        self._deliver_late()

    def fetch(self, fetches: Any) -> dict[str, Any]:
        """Computes fetches on the current state and the last run's batch and outputs,
        without a step and without hooks (TF's `FinalOpsHook` and `at_end` logging).

        Callables are jitted once per distinct set. Before the first run, the batch is
        None and the outputs are empty, so only callables that ignore them work.

        Args:
          fetches: as `RunArgs.fetches`.

        Returns:
          A dict of host NumPy values, keyed like `fetches`.
        """
        wanted = _fetches.normalize(fetches, "fetch(...)")
        if wanted is None:
            return {}
        batch, outputs = self._last_run
        if self._last_length > 1:  # the last step's batch of a multi-step run
            batch = jax.tree.map(lambda x: x[-1], batch)
        plan = _fetches.FetchPlan([("fetch(...)", wanted)])
        fetched = self._compiled.evaluate(plan.key, self._state, batch, outputs, plan.owners)
        [result] = plan.route(outputs, fetched)
        return jax.device_get(result)

    def _hook_failed(self, hook: Hook, event: str, step: int, error: Exception) -> None:
        """Re-raises `error` (called inside its `except`) with the hook and step noted,
        unless the hook's policy is to warn and the error is not control flow."""
        if isinstance(error, StopIteration):
            raise error
        if hook.on_error != "warn" or _errors.is_recoverable(error):
            error.add_note(f"(raised in {hook!r}.{event} at step {step})")
            raise error
        count = self._hook_failures[id(hook)] = self._hook_failures.get(id(hook), 0) + 1
        if count <= 3 or count in (10, 100) or count % 1000 == 0:
            logger.warning("%r.%s failed at step %d (failure %d; on_error='warn', so training goes on): %r",
                           hook, event, step, count, error, exc_info=count == 1)

    def _create_state(self, recovering: BaseException | None = None) -> None:
        """Restores or builds the state, then tells every hook; retries recoverable errors."""
        for attempt in itertools.count(1):
            try:
                restored = self._restore(recovering)
                self._rejected, self._data_rewound = None, False
                if restored is None:
                    self._state = self._init_fn()
                    self._step = self._initial_step
                    if self._warm_start is not None:
                        self._state, self.warm_start_report = _checkpoint.warm_start(self._state, self._warm_start)
                else:
                    self._resume(restored, recovering)
                if self._placement is not None and self._compiled.state_constraint is None:
                    self._compiled.state_constraint = _sharding.constrain(
                        self._placement.state_shardings(self._state))
                for hook in self._hooks:
                    try:
                        hook.after_create_session(self)
                    except Exception as error:
                        self._hook_failed(hook, "after_create_session", self._step, error)
                return
            except Exception as error:
                if recovering is not None and isinstance(error, _StateGone):
                    recovering.add_note(str(error))
                    raise recovering from None
                if not _errors.is_recoverable(error) or attempt > self._max_recoveries:
                    raise
                logger.warning("Retrying session creation after %r (attempt %d of %d).",
                               error, attempt, self._max_recoveries)

    def _restore(self, recovering: BaseException | None) -> _checkpoint.Restored | None:
        if self._checkpoint_dir is None or not _checkpoint.complete_steps(self._checkpoint_dir):
            return None
        if recovering is not None:
            for hook in self._hooks:  # a save in flight is the checkpoint to go back to
                hook.wait_until_finished()
        if self._like is None:
            self._like = (_restore_target(self._init_fn) if self._placement is None
                          else self._placement.like(jax.eval_shape(self._make_state)))
        checkpoints = _checkpoint.Checkpoints(self._checkpoint_dir)
        try:
            return checkpoints.restore_latest(self._like)
        finally:
            checkpoints.close()

    def _resume(self, restored: _checkpoint.Restored, recovering: BaseException | None) -> None:
        """Takes a restored checkpoint's state, step, data position and (at creation,
        not in a recovery, where hooks keep their own state as in TF) hook states."""
        self._state, self._step = restored.state, restored.step
        self.restored_step = restored.step
        meta = restored.meta
        data_state = meta.get("data")
        if data_state is not None:
            if hasattr(self._data, "set_state"):
                self._data.set_state(data_state)
                self._buffer.clear()
                self._data_rewound = True
            else:
                logger.warning("Checkpoint %d holds a data position, but this session's data has no set_state(); "
                               "the data restarts from where it is.", restored.step)
        elif self._data is not None and recovering is None and hasattr(self._data, "get_state"):
            logger.warning("Checkpoint %d holds no data position; the data restarts from its beginning.",
                           restored.step)
        if recovering is None:
            saved = meta.get("hooks") or {}
            for (key, hook), legacy in zip(_hook_keys(self._hooks), _legacy_hook_keys(self._hooks), strict=True):
                if key in saved or legacy in saved:
                    hook.set_state(saved[key] if key in saved else saved[legacy])
        logger.info("Restored step %d from %s.", restored.step, self._checkpoint_dir)

    def _poll_preemption(self) -> None:
        try:
            if multihost_utils.reached_preemption_sync_point(self._step):
                self.request_preemption()
        except RuntimeError as error:  # the service is off: nothing to poll
            logger.warning("Not polling JAX's preemption sync point: %s", error)
            self._sync_preemption = False

    def resume_info(self) -> dict[str, Any]:
        """What a checkpoint stores beside the state: the step, the data iterator's
        position (when it has `get_state()`), every hook's `get_state()`, the config,
        and the versions of jaxmon, JAX and Orbax. JSON-serialisable."""
        hooks = {}
        for key, hook in _hook_keys(self._hooks):
            state = hook.get_state()
            if state is not None:
                hooks[key] = state
        get_data_state = getattr(self._data, "get_state", None)
        if self._buffer:  # the position before the batches taken ahead for later runs
            get_data_state = lambda position=self._buffer[0][1]: position  # noqa: E731
        info = {
            **_checkpoint.versions(),
            "step": self._step,
            "data": get_data_state() if callable(get_data_state) else None,
            "hooks": hooks,
            "config": self._config,
        }
        return _checkpoint.check_json(info, "the checkpoint metadata (data get_state() and hooks' get_state())")

    # -- stopping and closing --------------------------------------------------------

    def should_stop(self) -> bool:
        """True once a stop was requested, data ended, the process got SIGTERM, or the
        session closed."""
        stop = self._stop_requested if self._agreement is None else self._agreed_stop
        return stop or self._preempted or self._closed

    def agree_all(self, flag: bool) -> bool:
        """Whether `flag` holds on every JAX process of the run: `flag` itself with one
        process, one small all-gather with several (every process must call it at the
        same point). Checkpoint saves use it, so that all processes save or none does.
        """
        if self._agreement is None:
            return bool(flag)
        try:
            return self._agreement.all(bool(flag), self._step)
        except _agree.PeerError as lost:
            self._lost_peer(lost)
            raise

    def snapshot(self) -> Snapshot | None:
        """What a checkpoint of the current step holds, or None when it must not be
        saved (logged). Late hooks are delivered first (`sync()`), so that a NaN check
        has passed on the state; with several JAX processes all of them save or none
        does (Orbax writes collectively), and an error of a late hook is raised once
        every process knows. Checkpoint savers call it at their save points."""
        error = None
        try:
            self.sync()
        except Exception as raised:
            error = raised
        if not self.agree_all(error is None and self._rejected is None):
            if error is not None:
                raise error
            logger.warning("Not saving a checkpoint of step %d: %s.", self._step,
                           self._rejected or "another JAX process cannot save it")
            return None
        return Snapshot(self._step, self._state, self.resume_info())

    def _lost_peer(self, error: _agree.PeerError) -> None:
        """A peer process is gone: say so now (JAX may abort this process at its
        shutdown barrier before a traceback is printed), and do not wait for
        checkpoint writes that need the dead process to commit."""
        self.peer_lost = True
        logger.error("%s", error)

    def reject_state(self, reason: str) -> None:
        """Marks the current state, and every later one of this session (until a
        recovery re-creates it), as not fit to save: checkpoint saves skip it. A
        `NanHook` that stops cleanly calls it, so no non-finite state is saved."""
        if self._rejected is None:
            self._rejected = reason

    @property
    def state_rejected(self) -> str | None:
        """Why the current state must not be saved (see `reject_state`), or None."""
        return self._rejected

    @property
    def preemption_requested(self) -> bool:
        """True once the process got SIGTERM (or, with several JAX processes, reached
        JAX's preemption sync point): the loop stops after this step is saved."""
        return self._preempted

    def request_preemption(self) -> None:
        """Acts as SIGTERM does: save at the next step boundary, then stop."""
        if not self._preempted:
            logger.warning("Preemption (SIGTERM or request_preemption()): saving at the next step boundary, then "
                           "stopping; a second SIGTERM exits at once.")
        self._preempted = True

    def request_stop(self) -> None:
        """Asks the loop to stop; `should_stop()` is True from now on."""
        self._stop_requested = True

    def close(self) -> None:
        """Ends the session: pending late results, every hook's `end`, then every hook's
        `close`, in list order. A second call does nothing."""
        self._close(clean=True)

    def _close(self, clean: bool) -> None:
        if self._closed:
            return
        self._closed = True
        ok = False
        if self._sigterm is not None:
            self._sigterm.uninstall()
        try:
            if clean:
                self._deliver_late()
                for hook in self._hooks:
                    try:
                        hook.end(self)
                    except Exception as error:
                        self._hook_failed(hook, "end", self._step, error)
            else:
                self._quietly(self._deliver_late, "delivering the last late results")
            ok = True
        finally:
            self._close_hooks(raise_errors=ok and clean)

    def _close_hooks(self, raise_errors: bool) -> None:
        """Every hook's `close`, even when one fails; the first error is raised after."""
        first = None
        for hook in self._hooks:
            try:
                hook.close()
            except Exception as error:
                if not raise_errors or hook.on_error == "warn":
                    logger.error("%r.close failed: %r", hook, error, exc_info=error)
                elif first is None:
                    error.add_note(f"(raised in {hook!r}.close)")
                    first = error
        if first is not None:
            raise first

    def _quietly(self, fn: Callable[[], None], what: str) -> None:
        try:
            fn()
        except Exception as error:
            logger.error("While closing after an error, %s failed: %r", what, error, exc_info=error)

    def __enter__(self) -> MonitoredSession:
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        end_of_data = exc_type is not None and issubclass(exc_type, StopIteration)
        if self._closed and exc_type is None:
            raise RuntimeError(
                "Session is already closed: close() was called inside the `with` block. "
                "Let the `with` block close the session, or call close() without `with`."
            )
        self._close(clean=exc_type is None or end_of_data)
        return end_of_data

    # -- read-only views ---------------------------------------------------------------

    @property
    def step(self) -> int:
        """The number of steps completed (a host int; never reads the device)."""
        return self._step

    @property
    def state(self) -> Any:
        """The current state (device arrays); still readable after close."""
        return self._state

    @property
    def last_outputs(self) -> Mapping[str, Any]:
        """The last run's outputs (device arrays); empty before the first run."""
        return self._last_run[1]

    @property
    def checkpoint_dir(self) -> str | None:
        """Where the session restores from (None: it never restores)."""
        return self._checkpoint_dir

    @property
    def hooks(self) -> tuple[Hook, ...]:
        return self._hooks

    @property
    def compile_count(self) -> int:
        """How many times the step was traced and compiled: once per distinct fetch set
        (and again only when the shapes of the state or batch change)."""
        return self._compiled.trace_count


class Snapshot(NamedTuple):
    """What a checkpoint of one step holds: the step, the state, and `resume_info()`."""

    step: int
    state: Any
    meta: dict[str, Any]


_NOTHING_FETCHED = _fetches.FetchPlan([("run(fetches=...)", None)])


def _to_host(values: Any) -> Any:
    """`jax.device_get`, with a fast path for the common few single arrays. An array
    spread over several processes must be replicated (a loss, a metric): each process
    then reads its own copy."""
    leaves, tree = jax.tree.flatten(values)
    if any(isinstance(leaf, jax.Array) and not leaf.is_fully_addressable for leaf in leaves):
        return tree.unflatten([_local_copy(leaf) if isinstance(leaf, jax.Array) else leaf for leaf in leaves])
    if len(leaves) > 4:
        return jax.device_get(values)
    return tree.unflatten([np.asarray(leaf) if isinstance(leaf, jax.Array) else leaf for leaf in leaves])


def _local_copy(array: jax.Array) -> np.ndarray:
    if array.is_fully_addressable:
        return np.asarray(array)
    if not array.is_fully_replicated:
        raise ValueError(
            f"A fetched value of shape {array.shape} is sharded across processes ({array.sharding}); every "
            "process reads fetches on the host, so fetch values replicated on every device: a mean or a "
            "sum (a loss, a metric), or jax.lax.with_sharding_constraint(x, jax.sharding.PartitionSpec()) "
            "in a fetch function.")
    return np.asarray(array.addressable_data(0))


def _restore_target(init_fn: Callable[[], Any]) -> Any:
    """The shapes, dtypes and shardings of the state `init_fn` builds, to restore into.

    `jax.eval_shape` builds nothing, but it loses shardings that `init_fn` sets with
    `jax.device_put` (those of a jitted `init_fn` with `out_shardings` survive); with
    several devices and a sharding lost, `init_fn` runs for real, once."""
    abstract = jax.eval_shape(init_fn)
    if jax.device_count() > 1 and any(getattr(leaf, "sharding", None) is None for leaf in jax.tree.leaves(abstract)):
        return _checkpoint.abstract_like(init_fn())
    return _checkpoint.abstract_like(abstract)


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


class _SigtermHandler:
    """Turns SIGTERM into `session.request_preemption()` while the session is open; a
    second SIGTERM goes to the handler that was there before (by default: exit)."""

    def __init__(self, session: MonitoredSession):
        self._session = session
        self._previous: Any = None
        self._installed = threading.current_thread() is threading.main_thread()
        if self._installed:
            self._previous = signal.signal(signal.SIGTERM, self._handle)
        else:
            logger.info("The session is not in the main thread, so it does not handle SIGTERM.")

    def _handle(self, signum, frame) -> None:
        if not self._session.preemption_requested:
            self._session.request_preemption()
            return
        self.uninstall()
        os.kill(os.getpid(), signal.SIGTERM)

    def uninstall(self) -> None:
        if self._installed:
            self._installed = False
            signal.signal(signal.SIGTERM, self._previous if self._previous is not None else signal.SIG_DFL)


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


def _check_hooks(hooks: Any) -> tuple[Hook, ...]:
    if isinstance(hooks, Hook):
        raise TypeError(f"hooks must be a list of Hook; got a single {hooks!r}. Pass hooks=[hook].")
    hooks = tuple(hooks)
    for i, hook in enumerate(hooks):
        if not isinstance(hook, Hook):
            raise TypeError(
                f"hooks[{i}] is {hook!r} of type {type(hook).__name__}, not a jaxmon Hook. "
                "Subclass jm.Hook and override the events you need."
            )
        _errors.check_on_error(hook, hook.on_error)
    return hooks


def _check_run_args(args: Any, hook: Hook) -> RunArgs:
    if args is None:
        return RunArgs()
    if not isinstance(args, RunArgs):
        raise TypeError(f"{hook!r}.before_run returned {args!r}; return jm.RunArgs(...) or None.")
    if args.feeds is not None and not isinstance(args.feeds, Mapping):
        raise TypeError(f"{hook!r}.before_run feeds {args.feeds!r}; feeds must be a dict {{key: value}}.")
    return args


class _Steps:
    """The batches of one multi-step run, stacked on a new leading axis when used."""

    def __init__(self, items: list[Any]):
        if not items:
            raise ValueError("run() was given an empty list of batches; give at least one.")
        self.items = items

    def stacked(self) -> Any:
        try:
            if all(isinstance(leaf, jax.Array) for leaf in jax.tree.leaves(self.items)):
                return _stack_on_device(self.items)  # one dispatch for every leaf
            return jax.tree.map(_stack, *self.items)
        except ValueError as error:
            raise ValueError(f"The {len(self.items)} batches of one run must have the same structure and "
                             f"shapes to be stacked for steps_per_dispatch: {error}") from None


def _stack(*leaves: Any) -> Any:
    return np.stack([np.asarray(leaf) for leaf in leaves])


@jax.jit
def _stack_on_device(items: list[Any]) -> Any:
    return jax.tree.map(lambda *leaves: jax.numpy.stack(leaves), *items)


def _merge_feeds(batch: Any, feeds: list[tuple[Hook, Mapping[str, Any]]]) -> Any:
    """Merges the hooks' feeds into a new batch dict; a key fed twice is an error."""
    merged: dict[str, Any] = {}
    owners: dict[str, Hook] = {}
    for hook, hook_feeds in feeds:
        for key, value in hook_feeds.items():
            if key in merged:
                raise RuntimeError(
                    f"Same batch key is fed by two hooks: {key!r} by {owners[key]!r} and "
                    f"{hook!r}. Let one hook feed it."
                )
            merged[key], owners[key] = value, hook
    if not merged:
        return batch
    if batch is None:
        return merged
    if not isinstance(batch, Mapping):
        raise TypeError(
            f"Hooks feed {sorted(merged)}, but the batch is a {type(batch).__name__}, not a "
            "dict; feeds need dict batches."
        )
    clash = sorted(set(merged) & set(batch))
    if clash:
        raise RuntimeError(
            f"Same batch key is fed by a hook and the caller: {clash} is already in the batch "
            f"(given to run() or taken from data) and fed by {', '.join(repr(owners[k]) for k in clash)}. "
            "Drop it from the batch or from the hook's feeds."
        )
    return {**batch, **merged}
