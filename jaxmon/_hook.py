"""The hook protocol: `Hook`, and the values passed around one run."""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from jaxmon._triggers import SecondOrStepTimer

if TYPE_CHECKING:
    from jaxmon._session import MonitoredSession

Fetches = Mapping[str, "str | Callable[..., Any]"] | Sequence[str] | str | None


class RunArgs(NamedTuple):
    """What a hook's `before_run` asks of one run (TF's `SessionRunArgs`); immutable.

    Attributes:
      fetches: values to compute inside the same compiled step and deliver to the
        hook's `after_run` as host NumPy, in TF's structure: an output name (a nested
        one by its path, `"grads/conv1/w"`) or a callable `fn(state, batch, outputs)
        -> pytree` (state is the post-step state) gives its value, a list of them a
        list, a dict `{result_name: name or fn}` a dict. Pass the same callable
        object each run: each distinct fetch set compiles once.
      feeds: entries merged into the batch for this run (the batch must be a dict).
      late: deliver this run's `after_run` one run later, after the next step was
        dispatched (or when the session syncs or closes), so that reading the
        fetched values never makes the device wait for the host. The hook still
        gets this run's context and values; only the call comes later, after its
        own `before_run` of the next run. Use it for observation (logging,
        summaries, NaN checks); leave it False where a decision must be taken on
        the exact step.
      read: read this hook's `accumulators` after this run (one asynchronous copy
        for every hook that reads at this run) and deliver them in
        `RunValues.accumulated`; each accumulator that `restarts` starts afresh.
    """

    fetches: Fetches = None
    feeds: Mapping[str, Any] | None = None
    late: bool = False
    read: bool = False


@dataclasses.dataclass(eq=False, slots=True)
class RunContext:
    """One run as the hooks see it; the same object goes to every hook's calls.

    Attributes:
      step: the step number before this run.
      session: the `MonitoredSession` running it.
      original_args: the caller's fetches, and this run's batch (given to `run()` or
        taken from `data`, before any hook's feeds) as `feeds`; with several steps per
        run, the list of their batches.
      steps: how many steps this run takes (1, or more with `steps_per_dispatch`).
    """

    step: int
    session: MonitoredSession
    original_args: RunArgs
    _stop_requested: bool = False
    steps: int = 1

    @property
    def next_step(self) -> int:
        """The step number after this run (`step + steps`): what a periodic hook asks
        its timer about in `before_run`."""
        return self.step + self.steps

    @property
    def stop_requested(self) -> bool:
        return self._stop_requested

    def request_stop(self) -> None:
        """Ask the session to stop after this run (every `after_run` still runs)."""
        self._stop_requested = True


class RunValues(NamedTuple):
    """What one run produced for a hook; immutable.

    Attributes:
      results: this hook's fetches as host NumPy in the structure it asked (a value,
        a list or a dict, see `RunArgs.fetches`); None when it asked for none.
      step: the step number after this run.
      outputs: the step's outputs as device arrays, unread (reading one, e.g. with
        `np.asarray`, waits for the step; in a late `after_run` it is done already).
      accumulated: the hook's `accumulators` as host values `{name: result}` when it
        asked to `read` at this run, else None.
    """

    results: Any
    step: int
    outputs: Mapping[str, Any] = types.MappingProxyType({})
    accumulated: dict[str, Any] | None = None


class Hook:
    """Base class of hooks: override the events you need; each default does nothing.

    Order of events: `begin` (every hook, at session construction) → state created or
    restored → `after_create_session` (again after every recovery) → per run:
    `before_run` → one compiled step → `after_run` → `end` on a clean exit →
    `close` on every exit.

    Errors raised in a hook carry a note naming the hook, the event and the step.
    Set `on_error = "warn"` (built-in observational hooks take it as an argument)
    to log a failing hook's errors and go on training instead of stopping the run;
    the default, `"raise"`, stops it.

    Example:
      >>> import jaxmon as jm
      >>> class PrintLoss(jm.Hook):
      ...     def before_run(self, ctx):
      ...         return jm.RunArgs(fetches="loss")
      ...     def after_run(self, ctx, values):
      ...         print(values.step, values.results)
    """

    def begin(self) -> None:
        """Called once, when the session is built, before any state exists."""

    def after_create_session(self, session: MonitoredSession) -> None:
        """Called when the state is ready: after creation and after each recovery."""

    def before_run(self, ctx: RunContext) -> RunArgs | None:
        """Called before each run; return `RunArgs` to fetch or feed values."""
        return None

    def after_run(self, ctx: RunContext, values: RunValues) -> None:
        """Called after each successful run with this hook's fetched values."""

    on_error: str = "raise"

    def end(self, session: MonitoredSession) -> None:
        """Called once on a clean exit (normal end, end of data, explicit close)."""

    def close(self) -> None:
        """Called once on every exit, clean or not, after `end`: flush and release
        files, writers and profilers here. Errors are raised on a clean exit and
        logged on an exit that is already raising."""

    def steps_to_next_trigger(self, step: int) -> int | None:
        """How many steps from `step` this hook next needs a run to end on, or None if
        any will do. With `steps_per_dispatch`, the session ends its runs there, so that
        the hook fires on its exact step. The default reads the hook's `timer` (when
        it counts steps); seconds-based hooks fire at run ends."""
        return None if self.timer is None else self.timer.steps_to_next_trigger(step)

    def get_state(self) -> dict[str, Any] | None:
        """The hook's own state to save with each checkpoint, JSON-serialisable, or None.

        The default saves the last trigger of the hook's `timer` if it has one; hooks
        with counters extend it."""
        return None if self.timer is None else {"timer": self.timer.get_state()}

    def set_state(self, state: dict[str, Any]) -> None:
        """Takes back what `get_state` returned, when a session resumes from a
        checkpoint: after `begin`, before `after_create_session`."""
        if self.timer is not None and "timer" in state:
            self.timer.set_state(state["timer"])

    #: The hook's periodic timer (a `SecondOrStepTimer`), if it acts every N steps or
    #: seconds. The session reads it through the methods above, and with several JAX
    #: processes makes it read the agreed clock (`SecondOrStepTimer.use_clock`).
    timer: SecondOrStepTimer | None = None

    #: Reductions over every step's values that the session computes on the device,
    #: inside the compiled step (each step of a multi-step run too), and keeps between
    #: runs outside the state: `{name: jm.Mean("loss")}` (see `jm.Reduction`). Set it
    #: in `__init__`. Nothing is read on the host until a run whose `before_run`
    #: returns `RunArgs(read=True)`, a checkpoint save, `sync()` or `close()`: at every
    #: such read, `after_read` gets the values. With several JAX processes every
    #: process must declare the same accumulators in the same hook order (each runs
    #: the same program); `MonitoredTrainingSession` does so for its chief-only hooks.
    accumulators: Mapping[str, Any] = types.MappingProxyType({})

    def after_read(self, step: int, values: dict[str, Any]) -> None:
        """Called at every read of the accumulators (any hook's, a save's, `sync()`'s,
        `close()`'s) with this hook's `{name: result}` after `step`, before the
        `after_run` that delivers them to the hooks that asked."""

    #: True for a hook with a `timer` whose `before_run` and `after_run` do nothing on a
    #: run that ends before the timer's next trigger (its next step, or its next time on
    #: the timer's clock): the session then skips both calls on such runs, so that the
    #: hook costs nothing between its triggers, and a run on which every hook sleeps
    #: calls none. A hook that counts runs or checks something on every run leaves it
    #: False.
    idle_between_triggers: bool = False

    def _idle_steps(self, step: int) -> int | None:
        """For a hook `idle_between_triggers`: how many steps from `step` its run events
        do nothing (0: call them on the next run), or None when steps do not bound it
        (its timer counts seconds, or never triggers)."""
        return 0 if self.timer is None else self.timer.steps_to_next_trigger(step)

    #: The directory this hook writes checkpoints to, if it does: a session given no
    #: `checkpoint_dir` restores from the first hook's.
    checkpoint_dir: str | None = None

    def wait_until_finished(self) -> None:
        """Blocks until work this hook has in flight (a checkpoint write) is done. The
        session calls it before a recovery restores the latest checkpoint."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


SessionRunHook = Hook
SessionRunArgs = RunArgs
SessionRunContext = RunContext
SessionRunValues = RunValues
