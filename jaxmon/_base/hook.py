"""The hook protocol: `Hook`, and the values passed around one run."""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple, Protocol

from jaxmon._base.triggers import Trigger

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
      restart: with `read`, False reads without starting the accumulators afresh:
        the window goes on (the built-in reporters' record after step 1, so that the
        one at step N covers steps 1..N).
    """

    fetches: Fetches = None
    feeds: Mapping[str, Any] | None = None
    late: bool = False
    read: bool = False
    restart: bool = True


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
    session: Session
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
        self.session.request_stop()


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

    A hook that acts only now and then says when (`next_trigger`): the session skips
    its run events until then, and a run every hook sleeps through calls none. A
    hook that saves checkpoints has `checkpoint_dir` and `wait_until_finished()` (the
    `Saver` protocol): the session restores from the first such directory.

    Example:
      >>> import jaxmon as jm
      >>> class PrintLoss(jm.Hook):
      ...     def before_run(self, ctx):
      ...         return jm.RunArgs(fetches="loss")
      ...     def after_run(self, ctx, values):
      ...         print(values.step, values.results)
    """

    #: "raise" (default): an error in the hook stops the run, with a note naming the
    #: hook, the event and the step; "warn": it is logged and training goes on.
    on_error: str = "raise"

    #: Reductions over every step's values, computed on the device inside the
    #: compiled step and read only at a `RunArgs(read=True)`, a save, `sync()` or
    #: `close()`: `{name: jm.Mean("loss")}` (see `jm.Reduction`). Set it in `__init__`.
    accumulators: Mapping[str, Any] = types.MappingProxyType({})

    def begin(self) -> None:
        """Called once, when the session is built, before any state exists."""

    def after_create_session(self, session: Session) -> None:
        """Called when the state is ready: after creation and after each recovery."""

    def before_run(self, ctx: RunContext) -> RunArgs | None:
        """Called before each run; return `RunArgs` to fetch or feed values."""
        return None

    def after_run(self, ctx: RunContext, values: RunValues) -> None:
        """Called after each successful run with this hook's fetched values."""

    def after_read(self, step: int, values: dict[str, Any]) -> None:
        """Called at every read of the accumulators (any hook's, a save's, `sync()`'s,
        `close()`'s) with this hook's `{name: result}` after `step`."""

    def end(self, session: Session) -> None:
        """Called once on a clean exit (normal end, end of data, explicit close)."""

    def close(self) -> None:
        """Called once on every exit, after `end`: release files and writers here.
        Errors are raised on a clean exit and logged on one already raising."""

    def next_trigger(self, step: int) -> Trigger | None:
        """When this hook next needs its run events, asked after the run that ended at
        `step` (before the first run, and after each run that called it): a `Trigger`
        (a step and/or a time; until then the session skips its `before_run` and
        `after_run`, and ends multi-step runs on its step), or None to be called on
        every run (the default)."""
        return None

    def get_state(self) -> dict[str, Any] | None:
        """The hook's own state to save with each checkpoint (JSON), or None."""
        return None

    def set_state(self, state: dict[str, Any]) -> None:
        """Takes back what `get_state` returned when a session resumes from a
        checkpoint: after `begin`, before `after_create_session`."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class Saver(Protocol):
    """A hook that writes checkpoints: the session restores from the first one's
    `checkpoint_dir`, and waits for its writes before a recovery restores."""

    checkpoint_dir: str

    def wait_until_finished(self) -> None: ...


class Session(Protocol):
    """What hooks use of a `MonitoredSession` (for type checkers)."""

    @property
    def step(self) -> int: ...
    @property
    def state(self) -> Any: ...
    def should_stop(self) -> bool: ...
    def request_stop(self) -> None: ...


SessionRunHook = Hook
SessionRunArgs = RunArgs
SessionRunContext = RunContext
SessionRunValues = RunValues
