"""MonitoredSession: the hooked, recoverable training loop around one compiled step.

One run: the batch (`BatchSource`), every awake hook's `before_run` as one `RunPlan`
(`HookRunner`), one dispatch that returns one `RunResult` (`Dispatch`), the
accumulators' read (`Accumulators`), then the `after_run`s (`HookRunner`); a run every
hook sleeps through takes the same path with the empty plan. Around it: the state's
life (`StateLife`: create, restore, recover), the stop decision (`Stopping`) and, with
several processes, the agreement points (`AgreedRuns`). What fails off the loop (a
save, a report) goes to the session's `Failures`, asked once per run, after its step.
`docs/architecture.md` draws the whole path.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import jax

from jaxmon._base import errors as _errors
from jaxmon._base import fetches as _fetches
from jaxmon._base.hook import Hook
from jaxmon._base.triggers import SecondOrStepTimer
from jaxmon._checkpoints.warm_start import WarmStartReport
from jaxmon._metrics.accumulators import Accumulators
from jaxmon._ops.failures import Failures
from jaxmon._ops.host_syncs import HostSyncs
from jaxmon._ops.time_spent import TimeSpent
from jaxmon._processes import agree as _agree
from jaxmon._processes.watchdog import Watchdog
from jaxmon._run import scan_unroll as _scan_unroll
from jaxmon._run import sharding as _sharding
from jaxmon._run.batches import BatchSource, as_run
from jaxmon._run.dispatch import Dispatch
from jaxmon._run.hook_runner import HookRunner
from jaxmon._run.state_life import Snapshot, StateLife
from jaxmon._run.stopping import Preemption, Stopping

logger = logging.getLogger("jaxmon")


class MonitoredSession:
    """Runs a step function with hooks: TF 1.x's `MonitoredSession`, made for JAX.

    The state (any pytree) flows through `step_fn(state, batch) -> (new_state, outputs)`, jitted, state donated.
    Each `run()` calls every `before_run`, dispatches ONE compiled step that also computes what hooks and caller
    fetch, then every `after_run`. A run in which nobody reads anything never waits for the device.

    Args:
      step_fn: `step_fn(state, batch) -> (new_state, outputs)`, pure, jittable, not jitted; outputs: {name: array}.
      init_fn: `init_fn() -> state`, called at creation and on recovery; give exactly one of `init_fn` and `state`.
      state: the initial state itself (it is donated to the first step).
      data: an iterable of batches; `run()` without a batch takes the next one; its end ends the session.
      hooks: `Hook` instances, called in list order.
      donate_state: donate the state's buffers to the step (a previous state's arrays die).
      initial_step: the step number a hand-restored initial state has completed.
      max_recoveries: retries of one `run()` (or the creation) after `AbortedError`/`UnavailableError` (TF: forever).
      checkpoint_dir: restore the latest complete checkpoint here (state, step, data position, hooks' states) at
        creation and after a recoverable error, else call `init_fn`. Default: the first saver hook's directory.
      warm_start: fresh starts only: a checkpoint whose leaves replace the fresh state's, or `fn(state) -> state`.
      config: a JSON-serialisable dict saved in every checkpoint's metadata.
      stop_grace_period_secs: the longest `close()` may wait for checkpoint writes.
      handle_sigterm: on SIGTERM or SIGHUP, or Ctrl-C inside `with`, save at the next step boundary and stop.
      mesh: a `jax.sharding.Mesh` the state and batches are placed on (see docs/processes.md, "Scaling out").
      state_sharding: None (leaves keep init_fn's NamedSharding on `mesh`, else replicated), a PartitionSpec,
        a prefix pytree of them, or `fn(abstract_state)`; batch_sharding: the same for one step's batch.
      steps_per_dispatch: up to this many steps per `run()` in one scan, cut at every exact step trigger (and
        agreement point); scan_unroll: its `unroll`, int, True or "auto" (see docs/performance.md, "Speed").
      max_dispatch_ahead: the most steps queued without a wait ("auto": 16 on several CPU devices, else None).
      prefetch: how many runs' batches of `data` are sent to the device ahead of their run (0: none).
      agree_every_n_steps: with several JAX processes, the most steps between two agreements (docs/processes.md).
      debug_host_syncs: the data or an every-run hook reading a device value, or a copy to the device at a
        dispatch, raises (docs/operations.md).
      watchdog_secs: no step in this long ends the process, exit 76 (watchdog_startup_secs: at start and close).

    Example:
      >>> import jax.numpy as jnp, jaxmon as jm
      >>> def step_fn(state, batch):
      ...     state = state + batch
      ...     return state, {"total": state}
      >>> with jm.MonitoredSession(step_fn, state=jnp.zeros(()), data=[1.0, 2.0, 3.0],
      ...                          hooks=[jm.StopAtStepHook(last_step=2)]) as sess:
      ...     while not sess.should_stop():
      ...         total = sess.run(fetches="total")
      >>> sess.step, float(total)
      (2, 3.0)
    """

    def __init__(self, step_fn: Callable[[Any, Any], tuple[Any, Mapping[str, Any]]],
                 init_fn: Callable[[], Any] | None = None, *, state: Any = None, data: Iterable[Any] | None = None,
                 hooks: Iterable[Hook] = (), donate_state: bool = True, initial_step: int = 0,
                 max_recoveries: int = 10, checkpoint_dir: str | os.PathLike | None = None,
                 warm_start: str | os.PathLike | Callable[[Any], Any] | None = None,
                 config: Mapping[str, Any] | None = None, stop_grace_period_secs: float = 120,
                 handle_sigterm: bool = True, mesh: jax.sharding.Mesh | None = None, state_sharding: Any = None,
                 batch_sharding: Any = None, max_dispatch_ahead: int | None | str = "auto",
                 steps_per_dispatch: int = 1, prefetch: int = 2, agree_every_n_steps: int = 16,
                 scan_unroll: int | bool | str = "auto", watchdog_secs: float | None = None,
                 watchdog_startup_secs: float = 600, debug_host_syncs: bool = False):
        _check_arguments(init_fn, state, initial_step, max_recoveries, stop_grace_period_secs, warm_start, mesh,
                         state_sharding, batch_sharding, steps_per_dispatch, prefetch, agree_every_n_steps,
                         scan_unroll, watchdog_secs, watchdog_startup_secs)
        placement = None if mesh is None else _sharding.Placement(mesh, state_sharding, batch_sharding)
        host_syncs, self._spent, self._failures = HostSyncs(debug_host_syncs), TimeSpent(), Failures()
        self._runner = HookRunner(hooks, host_syncs, self._spent, self._failures)
        self._accumulators = Accumulators(self.hooks)
        self._dispatch = Dispatch(step_fn, donate_state=donate_state, placement=placement, spent=self._spent,
                                  accumulators=self._accumulators, max_dispatch_ahead=max_dispatch_ahead,
                                  steps_per_dispatch=steps_per_dispatch, scan_unroll=scan_unroll,
                                  host_syncs=host_syncs)
        self.steps_per_dispatch, self.stop_grace_period_secs = steps_per_dispatch, stop_grace_period_secs
        self.max_dispatch_ahead = self._dispatch.max_dispatch_ahead
        self._batches = BatchSource(data, steps_per_dispatch, self._runner.run_limit, prefetch=prefetch,
                                    place=self._dispatch.place_run, host_syncs=host_syncs, spent=self._spent)
        self._life = StateLife(init_fn, state, placement=placement, checkpoint_dir=checkpoint_dir,
                               warm_start=warm_start, initial_step=initial_step, config=config,
                               hooks=self.hooks, batches=self._batches, accumulators=self._accumulators,
                               max_recoveries=max_recoveries, donate_state=donate_state, spent=self._spent)
        self._state, self._step, self._closed = None, initial_step, False
        several = jax.process_count() > 1
        self._preemption = Preemption(handle_sigterm=handle_sigterm, several_processes=several)
        self._stopping = Stopping(self._preemption, agreed=several)
        self._agreed = _agree.AgreedRuns(
            self._batches, self._runner, self._stopping, self, every_n_steps=agree_every_n_steps,
            recreate=lambda error: self._life.create(self._created, error), spent=self._spent.secs) if several else None
        if self._agreed is not None:
            _use_clock(self.hooks, self._agreed.clock)
        self._watchdog = Watchdog.of(lambda: (self._step, self._closed, self._life.restored_step), watchdog_secs,
                                     watchdog_startup_secs)
        try:
            with self._failures:  # what the hooks hand off in their events reports to this session
                self._runner.begin(initial_step)
                self._life.create(self._created)
        except BaseException:
            self._closed = True
            self._watchdog.stop()
            self._preemption.uninstall()  # the signal handlers go back to what they were
            self._batches.give_back()  # a loader's worker processes too
            self._runner.close(raise_errors=False)  # release what begin() opened
            raise

    def run(self, batch: Any = None, *, fetches: Any = None) -> Any:
        """Runs one step with every hook; returns its outputs or the caller's fetches.

        Args:
          batch: the step's batch; None takes the next item of `data`.
          fetches: values to return as host NumPy (see `RunArgs.fetches`).

        Returns:
          The step's `outputs` (device arrays, no host sync), or the fetches on the host.

        Raises:
          RuntimeError: the session was asked to stop, or is closed.
          StopIteration: `data` (or a hook) ended; inside `with`, the block ends cleanly.
        """
        if self._closed or self._stopping.decided:
            _refuse_run(self._closed)
        wanted = None if fetches is None else _fetches.normalize(fetches, "run(fetches=...)")
        with self._failures:  # what the hooks hand off in this run reports to this session
            if self._agreed is not None:
                return self._agreed.run(lambda batch: self._run_once(batch, fetches, wanted), batch)
            try:
                return self._attempts(batch, fetches, wanted)
            except StopIteration:
                self._stopping.request()  # end of data: a clean stop
                raise

    def _attempts(self, batch: Any, fetches: Any, wanted: dict | None) -> Any:
        """The run, taking its batch from `data` if none is given; after a recoverable
        error, the state re-created and the run tried again, up to `max_recoveries` times."""
        from_data = take = batch is None and self._batches.has_data
        attempt = 0
        while True:
            try:
                if take:
                    batch, take = self._batches.next(self._step), False
                return self._run_once(batch, fetches, wanted)
            except Exception as error:
                if (isinstance(error, StopIteration) or not _errors.is_recoverable(error)
                        or attempt == self._life.max_recoveries):
                    raise
                attempt += 1
                logger.warning("Recovering from %r (attempt %d of %d): re-creating the state.",
                               error, attempt, self._life.max_recoveries)
                if isinstance(error, _errors.RollbackError):
                    self._stopping.rolled_back()
                self._life.create(self._created, recovering=error)
                # A batch in hand is past the restored data position: take the next one.
                take = take or (from_data and self._life.data_rewound)

    def _run_once(self, batch: Any, fetches: Any, wanted: dict | None) -> Any:
        """One run: the awake hooks' `before_run`s as one plan, one dispatch, the `after_run`s."""
        steps, batch, given = as_run(batch, self.steps_per_dispatch)
        preemption = self._preemption
        if preemption.requested:  # a saver's next trigger is now
            self._runner.reschedule()
        plan = self._runner.before_run(self, self._step, steps=steps, fetches=fetches, batch=given,
                                       wake=wanted is not None)
        result = self._dispatch(self._state, batch, plan, wanted=wanted, steps=steps, step=self._step)
        self._state, self._step = result.state, self._step + steps
        if self._failures:  # a save or a report failed: stop now
            self._failures.raise_first(self._step)
        if preemption.polling or preemption.requested:  # JAX's sync point sees every step (else it does nothing)
            for done in range(self._step - steps + 1, self._step + 1):
                self._stopping.after_run(done)
        read = self._accumulators.read(self._step, plan.readers, plan.keeps) if plan.readers else None
        caller = self._runner.after_run(plan, result, self._step, read)
        return result.outputs if caller is None else caller

    def _created(self, state: Any, step: int) -> None:
        """A state was built or restored: keep it, then tell every hook."""
        self._spent.went_back(self._step, step)  # a recovery or roll-back: the steps after `step` are run again
        self._state, self._step = state, step
        self._dispatch.created(state)
        self._batches.unplace()
        self._accumulators.start(step, self._life.windows)
        self._runner.after_create_session(self)

    @property
    def time_spent(self) -> TimeSpent:
        """Where this session's wall time went, by category (`jm.GoodputHook` reports it)."""
        return self._spent

    @property
    def restored_step(self) -> int | None:
        """The step of the checkpoint the session was created from (None: a fresh start)."""
        return self._life.restored_step

    @property
    def warm_start_report(self) -> WarmStartReport | None:
        """What `warm_start` took (None: no warm start)."""
        return self._life.warm_start_report

    def sync(self) -> None:
        """Delivers every late `after_run` now (`RunArgs.late`), waits for the report thread and reads the hooks'
        accumulators (every `after_read`), waiting for the device only as long as that needs."""
        with self._failures:
            self._runner.sync(self._step)
            self._runner.after_read(self._accumulators.read_now(self._step))

    def fetch(self, fetches: Any) -> dict[str, Any]:
        """`fetches` on the state and last run's batch and outputs, as host NumPy, with no step (TF's FinalOpsHook)."""
        return self._dispatch.fetch(self._state, fetches)

    def snapshot(self) -> Snapshot | None:
        """What a checkpoint of this step holds (after `sync()`), or None (logged): unfit; every process agrees."""
        return self._life.snapshot(self._state, self._step, sync=self.sync, peers=self._agreed)

    def after_hooks(self, fn: Callable[[], Any]) -> None:
        """Calls `fn()` once every hook's event now under way is done (then saved, step N has them all)."""
        self._runner.later(fn)

    def resume_info(self) -> dict[str, Any]:
        """What a checkpoint stores beside the state (JSON): step, data position, hook states, config."""
        return self._life.resume_info(self._step)

    def agree_all(self, flag: bool) -> bool:
        """Whether `flag` holds on every JAX process (one small all-gather; all call it at one point)."""
        return bool(flag) if self._agreed is None else self._agreed.all(flag)

    def reject_state(self, reason: str) -> None:
        """Marks the current state, and every later one until a recovery, as not fit to save."""
        self._life.reject(reason)

    @property
    def state_rejected(self) -> str | None:
        """Why the current state must not be saved (see `reject_state`), or None."""
        return self._life.rejected

    @property
    def peer_lost(self) -> bool:  # True once another JAX process of the run stopped answering
        return self._agreed is not None and self._agreed.peer_lost

    def should_stop(self) -> bool:
        """True once a stop was requested, data ended, SIGTERM came, or the session closed."""
        return self._stopping.should_stop() or self._closed

    def request_stop(self) -> None:
        """Asks the loop to stop (several JAX processes: all stop at the next agreement point)."""
        self._stopping.request()

    @property
    def preemption_requested(self) -> bool:
        """True once SIGTERM, SIGHUP (or JAX's preemption sync point) asked to save and stop."""
        return self._preemption.requested

    @property
    def preemption_signal(self) -> int | None:
        """The signal that asked to save and stop (SIGTERM for `request_preemption()`), or None."""
        return self._preemption.signal

    def request_preemption(self) -> None:
        """Acts as SIGTERM does: save at the next step boundary, then stop."""
        self._preemption.request()

    def close(self) -> None:
        """Ends the session, once: `sync()`, every hook's `end`, then every `close`."""
        self._close(clean=True)

    def _close(self, clean: bool) -> None:
        if self._closed:
            return
        self._closed, ok = True, False
        self._preemption.uninstall()
        with self._failures:  # the last saves and reports report to this session
            try:
                if clean:
                    if self._agreed is not None:  # several processes: an error held since the last agreement
                        self._agreed.close()
                    self.sync()
                    self._runner.end(self)
                else:
                    _quietly(lambda: self._runner.sync(self._step), "delivering the last late results")
                ok = True
            finally:
                try:
                    self._dispatch.close()  # compilations ahead not started are dropped
                    self._batches.give_back()
                    self._runner.close(raise_errors=ok and clean)
                finally:
                    self._watchdog.stop()
        if clean:  # a report that failed while the hooks ended is raised here
            self._runner.sync(self._step)
        self._preemption.after_close(self._step)  # after a Ctrl-C, saved: KeyboardInterrupt

    def __enter__(self) -> MonitoredSession:
        self._preemption.catch_ctrl_c()  # inside `with` only: a session left open never swallows Ctrl-C
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        end_of_data = exc_type is not None and issubclass(exc_type, StopIteration)
        if self._closed and exc_type is None:
            raise RuntimeError("Session is already closed: close() was called inside the `with` block. "
                               "Let the `with` block close the session, or call close() without `with`.")
        interrupt = exc_type is not None and issubclass(exc_type, KeyboardInterrupt) and not self._preemption.requested
        self._close(clean=exc_type is None or end_of_data or interrupt)
        return end_of_data

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
        return self._dispatch.last_outputs

    @property
    def hooks(self) -> tuple[Hook, ...]:
        return self._runner.hooks

    @property
    def checkpoint_dir(self) -> str | None:
        """Where the session restores from (None: it never restores)."""
        return self._life.checkpoint_dir

    @property
    def compile_count(self) -> int:
        """How many times the step was compiled (per fetch set, run length off CPU, shapes; waits for those ahead)."""
        return self._dispatch.compile_count


def _refuse_run(closed: bool) -> None:
    if closed:
        raise RuntimeError("Run called on a closed session. Create a new session to train further.")
    raise RuntimeError("Run called even after should_stop requested. Check sess.should_stop() "
                       "before each run (`while not sess.should_stop(): sess.run()`).")


def _check_arguments(init_fn, state, initial_step, max_recoveries, stop_grace_period_secs, warm_start, mesh,
                     state_sharding, batch_sharding, steps_per_dispatch, prefetch, agree_every_n_steps,
                     scan_unroll, watchdog_secs, watchdog_startup_secs) -> None:
    """The checks of `MonitoredSession`'s arguments that need no state."""
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
    _errors.check_int("steps_per_dispatch", steps_per_dispatch, minimum=1)
    _errors.check_int("prefetch", prefetch)
    _errors.check_int("agree_every_n_steps", agree_every_n_steps, minimum=1)
    _scan_unroll.check_scan_unroll(scan_unroll)
    if watchdog_secs is not None:
        _errors.check_number("watchdog_secs", watchdog_secs, positive=True)
    _errors.check_number("watchdog_startup_secs", watchdog_startup_secs, positive=True)


def _quietly(fn: Callable[[], None], what: str) -> None:
    try:
        fn()
    except Exception as error:
        logger.error("While closing after an error, %s failed: %r", what, error, exc_info=error)


def _use_clock(hooks: Iterable[Hook], clock: Callable[[], float]) -> None:
    """Points every seconds-based trigger of `hooks` at `clock` (with several processes:
    the chief's, agreed at each agreement point)."""
    for hook in hooks:
        timer = getattr(hook, "timer", None)
        if isinstance(timer, SecondOrStepTimer):
            timer.use_clock(clock)
