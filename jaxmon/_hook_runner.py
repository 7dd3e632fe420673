"""The hooks of a session and their events: list order, late delivery, error policy."""

from __future__ import annotations

import collections
import logging
import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import jax
import numpy as np

from jaxmon import _errors
from jaxmon._errors import NanLossDuringTrainingError
from jaxmon._hook import Hook, RunArgs, RunContext, RunValues

logger = logging.getLogger("jaxmon")


class Requests:
    """What the hooks asked of one run, in hook order.

    Attributes:
      now: `[hook, results]` of the hooks whose `after_run` follows this run.
      late: the same for those asking for late delivery (`RunArgs.late`).
      asking: `(entry, args)` of the hooks that fetch or feed; `entry` is the hook's
        list in `now` or `late`, whose `results` the run fills in.
      reading: the entries of the hooks that read their accumulators at this run.

    An entry is `[hook, results, read]`: `read` is the run's `_monitors.Read` for a
    hook that reads, else None.
    """

    __slots__ = ("now", "late", "asking", "reading")

    def __init__(self):
        self.now: list[list] = []
        self.late: list[list] = []
        self.asking: list[tuple[list, RunArgs]] = []
        self.reading: list[list] = []


class HookEvents:
    """Calls every hook's events in list order and applies each hook's `on_error`.

    Runs whose hooks asked for late delivery wait in a queue until the next run was
    dispatched (or until `deliver_late()`); a stop any hook asks for goes to
    `request_stop`.

    Args:
      hooks: the session's hooks.
      request_stop: called when a hook's `after_run` asked to stop.
    """

    def __init__(self, hooks: Iterable[Hook], request_stop: Callable[[], None]):
        self.hooks = _check_hooks(() if hooks is None else hooks)
        # (hook, whether it has a before_run, whether it has an after_run, whether it sleeps
        # between triggers): a run calls no event that does nothing on it.
        self._calls = [(hook, _has(hook, "before_run"), _has(hook, "after_run"), _sleeps(hook)) for hook in self.hooks]
        self._wake = [_AWAKE] * len(self._calls)  # (step, clock, time) a sleeping hook's next call must reach
        # Runs that end before this step, while every clock is before its time, call no hook.
        self._quiet_step, self._deadlines = 0, []
        self._request_stop = request_stop
        self._late: collections.deque = collections.deque()
        self._failures: dict[int, int] = {}
        # What hooks asked to do once every hook's current event is done (see `later`),
        # and the hook whose event is running; None outside events.
        self._later: list[tuple[Hook | None, Callable[[], Any]]] | None = None
        self._current: Hook | None = None

    def begin(self, step: int) -> None:
        self._each("begin", step)

    def after_create_session(self, session: Any) -> None:
        self._wake, self._quiet_step = [_AWAKE] * len(self._calls), 0
        self._each("after_create_session", session.step, session)

    def end(self, session: Any) -> None:
        self._each("end", session.step, session)

    def _each(self, event: str, step: int, *args: Any) -> None:
        """Calls `event(*args)` of every hook in list order, under its error policy."""
        outer = self._open()
        try:
            for hook in self.hooks:
                self._current = hook
                try:
                    getattr(hook, event)(*args)
                except Exception as error:
                    self.failed(hook, event, step, error)
            self._run_later(event, step)
        finally:
            self._later, self._current = outer

    def later(self, fn: Callable[[], Any]) -> None:
        """Calls `fn()` once every hook's event now under way (`after_create_session`,
        the `after_run`s of a run, `end`) is done, under the error policy of the hook
        that asked; outside any event, now. A checkpoint taken there holds every
        hook's view of its step, whatever the hook order."""
        if self._later is None:
            fn()
        else:
            self._later.append((self._current, fn))

    def _open(self) -> tuple[Any, Hook | None]:
        """Starts collecting `later` calls; returns what to restore after."""
        outer = (self._later, self._current)
        self._later = []
        return outer

    def _run_later(self, event: str, step: int) -> None:
        while self._later:
            hook, fn = self._later.pop(0)
            self._current = hook
            try:
                fn()
            except Exception as error:
                if hook is None:
                    raise
                self.failed(hook, event, step, error)

    def steps_to_next_trigger(self, step: int, limit: int) -> int:
        """`limit`, cut to the next step some hook must end a run on."""
        for hook in self.hooks:
            steps = hook.steps_to_next_trigger(step)
            if steps is not None:
                limit = min(limit, steps)
        return limit

    def quiet(self, next_step: int) -> bool:
        """Whether a run that ends at `next_step` calls no hook: every hook with run
        events sleeps past it (see `Hook.idle_between_triggers`). Such a run skips
        `before_run` (and its `Requests`) altogether; late results of the run before
        are still delivered after it (`deliver_late`)."""
        if next_step >= self._quiet_step:
            return False
        for clock, deadline in self._deadlines:
            if clock() >= deadline:
                return False
        return True

    def next_event(self) -> tuple[float, float]:
        """`(step, time)`: the step of the next run that calls a hook (at most the current
        step: the next run; inf: none), and the earliest time on its clock at which a
        sleeping hook wakes (inf: none). Several processes agree on these."""
        return self._quiet_step, min((deadline for _, deadline in self._deadlines), default=math.inf)

    def before_run(self, ctx: RunContext) -> Requests:
        requests = Requests()
        next_step = ctx.step + ctx.steps
        wake_all = getattr(ctx.session, "preemption_requested", False)  # a save due now (CheckpointSaverHook)
        for i, (hook, before, after, idle) in enumerate(self._calls):
            if idle and not wake_all:
                wake, clock, deadline = self._wake[i]
                if next_step >= wake or (clock is not None and clock() >= deadline):
                    wake, clock, deadline = self._wake[i] = _wake(hook, ctx.step)
                if next_step < wake and (clock is None or clock() < deadline):
                    continue  # nothing to do before its next trigger
            if not before:
                if after:
                    requests.now.append([hook, None, None])
                continue
            try:
                args = hook.before_run(ctx)
                if args is not None:
                    args = _check_run_args(args, hook)
            except Exception as error:
                self.failed(hook, "before_run", ctx.step, error)  # a warn-policy hook sits out
                continue
            entry = [hook, None, None]
            if args is None:
                if after:
                    requests.now.append(entry)
                continue
            (requests.late if args.late else requests.now).append(entry)
            if args.fetches is not None or args.feeds:
                requests.asking.append((entry, args))
            if args.read:
                requests.reading.append(entry)
        return requests

    def after_run(self, ctx: RunContext, step: int, outputs: Any, requests: Requests, caller: Any,
                  fetching: list[list], results: list[Any]) -> Any:
        """Delivers the previous run's late `after_run`s, queues this run's, then calls
        this run's other `after_run`s; returns the caller's fetches on the host. One
        host read serves the caller and every hook that reads now. `results` are the
        values of the hooks whose entries are `fetching`, in that order."""
        if fetching:
            for entry, hook_results in zip(fetching, results, strict=True):
                entry[1] = hook_results
        if self._late:
            self.deliver_late()  # the previous run's: the device already has this one queued
        if requests.late:
            self._late.append((ctx, step, outputs, requests.late))
        if caller is not None or (fetching and any(entry[1] is not None for entry in requests.now)):
            caller, host = to_host((caller, [entry[1] for entry in requests.now]))
            for entry, results in zip(requests.now, host, strict=True):
                entry[1] = results
        if requests.now or ctx.stop_requested:
            self._call_after_run(ctx, step, outputs, requests.now)
        self._settle(step)
        return caller

    def _settle(self, step: int) -> None:
        """After a run's events: until which step (and time) every hook sleeps, so that
        the runs before it are quiet (see `quiet`)."""
        quiet, deadlines = math.inf, []
        for i, (hook, before, after, idle) in enumerate(self._calls):
            if not idle:
                if before or after:
                    quiet = 0
                continue
            wake, clock, deadline = self._wake[i]
            if step + 1 >= wake or (clock is not None and clock() >= deadline):
                wake, clock, deadline = self._wake[i] = _wake(hook, step)
            quiet = min(quiet, wake)
            if clock is not None:
                deadlines.append((clock, deadline))
        self._quiet_step, self._deadlines = quiet, deadlines

    def deliver_late(self) -> None:
        """Calls the `after_run` of every run whose hooks asked for late delivery."""
        while self._late:
            ctx, step, outputs, entries = self._late.popleft()
            if any(entry[1] is not None for entry in entries):
                host = to_host([entry[1] for entry in entries])
                entries = [[entry[0], r, entry[2]] for entry, r in zip(entries, host, strict=True)]
            self._call_after_run(ctx, step, outputs, entries)

    def _call_after_run(self, ctx: RunContext, step: int, outputs: Any, entries: list[list]) -> None:
        plain = RunValues(None, step, outputs)
        outer = self._open()
        try:
            for hook, results, read in entries:
                accumulated = None if read is None else read.values(hook)  # every hook's after_read first
                self._current = hook
                try:
                    if results is None and accumulated is None:
                        hook.after_run(ctx, plain)
                    else:
                        hook.after_run(ctx, RunValues(results, step, outputs, accumulated))
                except Exception as error:
                    self.failed(hook, "after_run", step, error)
            self._run_later("after_run", step)
        finally:
            self._later, self._current = outer
        if ctx.stop_requested:
            self._request_stop()

    def after_read(self, step: int, values: list[tuple[Hook, dict[str, Any]]]) -> None:
        """Every `after_read` of one read of the accumulators, in list order."""
        for hook, hook_values in values:
            try:
                hook.after_read(step, hook_values)
            except Exception as error:
                self.failed(hook, "after_read", step, error)

    def close(self, raise_errors: bool) -> None:
        """Every hook's `close`, even when one fails; the first error is raised after."""
        first = None
        for hook in self.hooks:
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

    def failed(self, hook: Hook, event: str, step: int, error: Exception) -> None:
        """Re-raises `error` (called inside its `except`) with the hook and step noted,
        unless the hook's policy is to warn and the error is not control flow."""
        if isinstance(error, StopIteration):
            raise error
        if hook.on_error != "warn" or _errors.is_recoverable(error) or isinstance(error, NanLossDuringTrainingError):
            error.add_note(f"(raised in {hook!r}.{event} at step {step})")
            raise error
        count = self._failures[id(hook)] = self._failures.get(id(hook), 0) + 1
        if count <= 3 or count in (10, 100) or count % 1000 == 0:
            logger.warning("%r.%s failed at step %d (failure %d; on_error='warn', so training goes on): %r",
                           hook, event, step, count, error, exc_info=count == 1)


def to_host(values: Any) -> Any:
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


def _has(hook: Hook, event: str) -> bool:
    """Whether `hook` does something on `event` (the base class's does nothing)."""
    return event in vars(hook) or getattr(type(hook), event) is not getattr(Hook, event)


def _sleeps(hook: Hook) -> bool:
    """Whether the session may skip `hook`'s run events between its triggers: it
    says so (`idle_between_triggers`), and no subclass or instance of the class that
    said so replaced those events."""
    if not hook.idle_between_triggers or {"before_run", "after_run"} & set(vars(hook)):
        return False
    for cls in type(hook).__mro__:
        if "idle_between_triggers" in vars(cls):
            return True
        if {"before_run", "after_run"} & set(vars(cls)):
            return False
    return False


_AWAKE = (0, None, None)


def _wake(hook: Hook, step: int) -> tuple[float, Callable[[], float] | None, float | None]:
    """`(step, clock, time)`: the step a sleeping `hook`'s next call must reach, or
    the time on `clock` it must reach first (None for none); `_AWAKE` when it must be
    called on the next run."""
    steps = hook._idle_steps(step)  # noqa: SLF001 (the sleeping seam of the built-in hooks)
    if steps == 0:
        return _AWAKE
    wake = math.inf if steps is None else step + steps
    timer = hook.timer
    if timer is not None and timer.every_steps is None:  # seconds, or never
        deadline = timer.next_trigger_time()
        if deadline is None:
            return _AWAKE  # not triggered yet: due now
        if deadline != math.inf:
            return wake, timer.clock, deadline
    return _AWAKE if wake == math.inf and timer is None else (wake, None, None)


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
    if not isinstance(args, RunArgs):
        raise TypeError(f"{hook!r}.before_run returned {args!r}; return jm.RunArgs(...) or None.")
    if args.feeds is not None and not isinstance(args.feeds, Mapping):
        raise TypeError(f"{hook!r}.before_run feeds {args.feeds!r}; feeds must be a dict {{key: value}}.")
    return args
