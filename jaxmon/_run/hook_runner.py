"""The hook runner: calls every hook's events in list order under its error policy,
sleeps hooks between their triggers, and delivers each run's values, late ones a run
later (the hooks that only report them: on the report thread, `_off_loop`). A run's
requests are one immutable `RunPlan`; its values come back as one `RunResult` (see
`_dispatch`)."""

from __future__ import annotations

import collections
import contextlib
import logging
import math
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from jaxmon._base import errors as _errors
from jaxmon._base.errors import NanLossDuringTrainingError
from jaxmon._base.hook import Hook, RunArgs, RunContext, RunValues
from jaxmon._base.schedule import schedule_of, steps_to
from jaxmon._base.triggers import Trigger
from jaxmon._ops import report_thread as _off_loop
from jaxmon._ops.host_syncs import HostSyncError, HostSyncs
from jaxmon._ops.time_spent import category_of
from jaxmon._run.fetches import normalize
from jaxmon._run.host import to_host
from jaxmon._run.plan import NO_RESULTS, QUIET, Call, RunPlan, RunResult
from jaxmon._writers import background

logger = logging.getLogger("jaxmon")


_AS_IS = contextlib.nullcontext()
#: A hook's trigger when it must be called on the next run (asked again then).
_NOW = Trigger(step=0)
_new_tuple = tuple.__new__


class HookRunner:
    """Calls every hook's events in list order and applies each hook's `on_error`.

    A hook's `next_trigger` says until when it sleeps: a run that ends before every
    hook's trigger calls no hook (`QUIET`). Runs whose hooks asked for late delivery
    wait in a queue until the next run was dispatched (or until `deliver_late()`); there, the
    `after_run`s that only report (`_off_loop.reports`) go to the report thread, whose failures
    are raised after the next run's step (or by `sync()`).

    Args:
      hooks: the session's hooks.
      host_syncs: with `debug_host_syncs`, the guard the events of the hooks called on
        every run (no `next_trigger`) run under.
      spent: the session's seconds by category: each hook's events add to its own.
    """

    def __init__(self, hooks: Iterable[Hook] | None, host_syncs: HostSyncs | None = None,
                 spent: dict[str, float] | None = None):
        self.hooks = _check_hooks(() if hooks is None else hooks)
        # The session's seconds by category (`_goodput`), and the category of each hook's time.
        self._spent = spent
        self._categories = {} if spent is None else {id(hook): category_of(hook) for hook in self.hooks}
        self._timing = False  # an event is being timed
        self._syncs = host_syncs if host_syncs is not None and host_syncs.enabled else None
        # The hooks between their triggers on every run, and the words of their reads' errors (debug_host_syncs).
        self._schedules = [schedule_of(hook) for hook in self.hooks]
        self._guarded = {} if self._syncs is None else {
            id(hook): f"in {hook!r}, a hook called on every run (it has no next_trigger)"
            for hook, schedule in zip(self.hooks, self._schedules, strict=True) if schedule.next is None}
        # (hook, has a before_run, has an after_run, its `next_trigger` (None: called on every run), its plain
        # `Call`, its late after_run only reports): a run calls no event that does nothing on it.
        self._calls = [(hook, _has(hook, "before_run"), _has(hook, "after_run"), schedule.next, Call(hook),
                        _off_loop.reports_off_loop(hook))
                       for hook, schedule in zip(self.hooks, self._schedules, strict=True)]
        self._wake = [_NOW] * len(self._calls)  # each hook's next trigger, as it last said
        self._sleepers = [(i, ask) for i, (_, _, _, ask, _, _) in enumerate(self._calls) if ask is not None]
        self._awake = any(ask is None and (before or after)  # a hook called on every run
                          for _, before, after, ask, _, _ in self._calls)
        self._made: list[tuple[RunArgs | None, Call | None]] = [(None, None)] * len(self._calls)  # each hook's last
        self._plans: dict[tuple[int, ...], tuple[list[Call], RunPlan]] = {}  # by the ids of the awake hooks' calls
        self._silent = {id(hook) for hook, _, after, _, _, _ in self._calls if not after}  # hooks with no after_run
        # Runs that end before this step, while every clock is before its time, call no hook.
        self._quiet_step, self._deadlines = 0, []
        self._late: collections.deque = collections.deque()
        self._failures: dict[int, int] = {}
        # What hooks asked to do once every hook's current event is done (see `later`),
        # and the hook whose event is running; None outside events.
        self._later: list[tuple[Hook | None, Callable[[], Any]]] | None = None
        self._current: Hook | None = None

    def begin(self, step: int) -> None:
        _off_loop.forget_failed()  # an earlier session's, never raised: logged, not raised in this one
        self._each("begin", step)

    def after_create_session(self, session: Any) -> None:
        self.reschedule()
        self._each("after_create_session", session.step, session)

    def end(self, session: Any) -> None:
        self._each("end", session.step, session)

    def reschedule(self) -> None:
        """Asks every hook its next trigger again at the next run (after a restore, or
        once a preemption makes a saver due now)."""
        self._wake, self._quiet_step = [_NOW] * len(self._calls), 0

    def _each(self, event: str, step: int, *args: Any) -> None:
        """Calls `event(*args)` of every hook in list order, under its error policy."""
        outer = self._open()
        try:
            for hook in self.hooks:
                self._current, started = hook, self._start()
                try:
                    getattr(hook, event)(*args)
                except Exception as error:
                    self.failed(hook, event, step, error)
                finally:
                    self._took(hook, started)
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
            self._current, started = hook, self._start()
            try:
                fn()
            except Exception as error:
                if hook is None:
                    raise
                self.failed(hook, event, step, error)
            finally:
                self._took(hook, started)

    def run_limit(self, step: int, limit: int) -> int:
        """`limit`, cut to the next step some hook must end a run on. A sleeping hook's
        trigger is the one it last gave (its state changes only in its own events)."""
        for i, schedule in enumerate(self._schedules):
            if schedule.cut is None:
                continue
            trigger = self._wake[i]
            steps = schedule.cut(step) if schedule.next is None or trigger.step <= step else steps_to(trigger, step)
            if steps is not None and steps < limit:
                limit = steps
        return limit

    def next_event(self) -> tuple[float, float]:
        """`(step, time)`: the step of the next run that calls a hook (at most the current
        step: the next run; inf: none), and the earliest time on its clock at which a
        sleeping hook wakes (inf: none). Several processes agree on these."""
        return self._quiet_step, min((deadline for _, deadline in self._deadlines), default=math.inf)

    def before_run(self, session: Any, step: int, length: int, fetches: Any, batch: Any,
                   wake: bool = False) -> RunPlan:
        """Every awake hook's `before_run` for the run of `length` steps after `step`, as
        one plan; `QUIET` when every hook sleeps past it (see `Hook.next_trigger`) and
        nothing else (`wake`) needs them. `fetches` and `batch` are the caller's."""
        if not wake and step + length < self._quiet_step:
            for clock, deadline in self._deadlines:
                if clock() >= deadline:
                    break
            else:
                return QUIET
        return self._plan(RunContext(step, session, _new_tuple(RunArgs, (fetches, batch, False, False)), False, length))

    def _plan(self, ctx: RunContext) -> RunPlan:
        """The `before_run` of every hook awake for the run of `ctx`."""
        step, next_step = ctx.step, ctx.step + ctx.steps
        made, feeds, wake, kept = [], [], self._wake, self._made  # made: the awake hooks' `Call`s
        last = None if self._spent is None or self._timing else time.perf_counter()  # `_start()`, inline: each
        self._timing = self._timing or last is not None  # awake hook's time runs from the end of the one before
        try:
            for i, (hook, before, after, ask, plain, reports) in enumerate(self._calls):
                if ask is not None:  # asleep: before its trigger's step and time
                    trigger = wake[i]
                    if trigger is _NOW:  # not asked since it was created, or it said "the next run": ask
                        trigger = wake[i] = ask(step) or _NOW
                    if next_step < trigger.step and (trigger.clock is None or trigger.clock() < trigger.time):
                        continue  # nothing to do before its next trigger
                args = None
                if before:
                    try:
                        if self._guarded:
                            with self._guard(hook):
                                args = hook.before_run(ctx)
                        else:  # the common case, without a context to enter
                            args = hook.before_run(ctx)
                        if args is not None and args is not kept[i][0]:
                            args = _check_run_args(args, hook)
                    except Exception as error:
                        self.failed(hook, "before_run", step, error)  # a warn-policy hook sits out
                        continue
                    finally:
                        if last is not None:  # inline: a trigger run times every awake hook
                            now = time.perf_counter()
                            self._spent[self._categories[id(hook)]] += now - last
                            last = now
                if args is None:
                    if after:
                        made.append(plain)
                    continue
                if kept[i][0] is not args:  # a hook that returns the same `RunArgs` again gets the same `Call`
                    kept[i] = (args, Call(hook, args.late, None if args.fetches is None else
                                          normalize(args.fetches, hook), args.read, reports and args.late))
                made.append(kept[i][1])
                if args.feeds:
                    feeds.append((hook, args.feeds))
        finally:
            if last is not None:
                self._timing = False
        if not made:
            return RunPlan(ctx)
        plans, key = self._plans, tuple(map(id, made))  # the same calls as a run before: the same plan
        kept_plan = plans.get(key)
        if kept_plan is None:
            if len(plans) >= 64:  # hooks that ask anew every time
                plans.clear()
            kept_plan = plans[key] = (made, RunPlan.of(None, tuple(made), without=self._silent))  # made: ids held
        return _new_tuple(RunPlan, (ctx, kept_plan[1].calls, tuple(feeds), *kept_plan[1][3:]))

    def after_run(self, plan: RunPlan, result: RunResult, step: int, read: Any = None) -> Any:
        """Delivers the previous run's late `after_run`s, queues this run's, then calls
        this run's other `after_run`s with their values; returns the caller's fetches
        on the host. One host read serves the caller and every hook called now.

        Args:
          plan: the run's plan.
          result: the run's result.
          step: the step number after the run.
          read: the run's read of the accumulators (`_metrics.Read`), if any hook read.
        """
        if background.FAILED or _off_loop.FAILED:  # a report failed: stop now (after the step:
            self._raise_reported()  # with several processes, an error there is agreed by every one)
        if self._late:
            self.deliver_late()  # the previous run's: the device already has this one queued
        if plan is QUIET:
            return None
        results = result.results  # a tuple, or values routed when asked for (`_fetches.Routed`: not asked its len)
        if type(results) is tuple and not results:
            results = NO_RESULTS
        if plan.late or plan.away or read:  # a read's `after_read`s are late too
            self._late.append((plan, result.outputs, step, read, results))
        caller, now, fetched = result.caller, plan.now, None
        if caller is not None or (plan.fetch_now and results is not NO_RESULTS):
            caller, host = to_host((caller, [results[i] for i in now]))
            fetched = dict(zip(now, host, strict=True))
        if now:
            self._call_after_run(plan, now, fetched, result.outputs, step, read)
        self._settle(step)
        if not self._late:  # else with the late ones, after the next run's step: one wake-up of the thread
            _off_loop.flush()  # the run's reports to the report thread
        return caller

    def _settle(self, step: int) -> None:
        """After a run's events: until which step (and time) every hook sleeps, so that
        the runs before it are quiet."""
        quiet, deadlines, wake = 0 if self._awake else math.inf, [], self._wake
        for i, ask in self._sleepers:
            trigger = wake[i]
            if step + 1 >= trigger.step or (trigger.clock is not None and trigger.clock() >= trigger.time):
                trigger = wake[i] = ask(step) or _NOW
            if trigger.step < quiet:
                quiet = trigger.step
            if trigger.clock is not None and trigger.time != math.inf:
                deadlines.append((trigger.clock, trigger.time))
        self._quiet_step, self._deadlines = quiet, deadlines

    def deliver_late(self) -> None:
        """Calls the `after_run` of every run whose hooks asked for late delivery (those
        that only report: queued on the report thread)."""
        while self._late:
            plan, outputs, step, read, results = self._late.popleft()
            if read:
                read.host()  # every `after_read`, on the loop
            if plan.away:
                _off_loop.submit(self._report, plan, results, outputs, step, read)
            if not plan.late:
                continue
            results = None if results is NO_RESULTS else dict(zip(plan.late, to_host(
                [results[i] for i in plan.late]), strict=True))
            self._call_after_run(plan, plan.late, results, outputs, step, read)
        _off_loop.flush()

    def sync(self) -> None:
        """Delivers every late `after_run` and waits for the report thread; raises what failed there."""
        self.deliver_late()
        _off_loop.wait()
        self._raise_reported()

    def _report(self, plan: RunPlan, results: Any, outputs: Any, step: int, read: Any) -> None:
        """The `after_run`s of the calls of `plan` that only report, on the report thread."""
        for i in plan.away:
            call = plan.calls[i]
            try:
                fetched = results[i]
                accumulated = read.values(call.hook) if call.read and read else None
                call.hook.after_run(plan.ctx, RunValues(None if fetched is None else to_host(fetched), step,
                                                        outputs, accumulated))
            except Exception as error:
                if self._raises(call.hook, error):
                    error.add_note(f"(raised in {call.hook!r}.after_run at step {step}, on the report thread)")
                    _off_loop.FAILED.append(error)
                else:
                    self._warn(call.hook, "after_run", step, error)

    def _raise_reported(self) -> None:
        """Raises the first failure on the report thread (a summary write, a reporting `after_run`)."""
        background.raise_failed_write()
        _off_loop.raise_failed()

    def _call_after_run(self, plan: RunPlan, indices: tuple[int, ...], results: Mapping[int, Any] | None,
                        outputs: Any, step: int, read: Any) -> None:
        """The `after_run` of the calls of `plan` numbered `indices`, with their `results` (None: none fetched)."""
        plain = _new_tuple(RunValues, (None, step, outputs, None))  # RunValues(None, step, outputs), faster
        outer, self._later = (self._later, self._current), []  # `_open()` and `_start()`, inline as in `_plan`
        last = None if self._spent is None or self._timing else time.perf_counter()
        self._timing = self._timing or last is not None
        try:
            try:
                for i in indices:
                    call = plan.calls[i]
                    accumulated = read.values(call.hook) if call.read and read is not None else None
                    fetched = None if results is None else results[i]
                    self._current = call.hook
                    try:
                        values = plain if fetched is None and accumulated is None else RunValues(
                            fetched, step, outputs, accumulated)
                        if self._guarded:
                            with self._guard(call.hook):
                                call.hook.after_run(plan.ctx, values)
                        else:  # the common case, without a context to enter
                            call.hook.after_run(plan.ctx, values)
                    except Exception as error:
                        self.failed(call.hook, "after_run", step, error)
                    finally:
                        if last is not None:  # as in `_plan`
                            now = time.perf_counter()
                            self._spent[self._categories[id(call.hook)]] += now - last
                            last = now
            finally:
                if last is not None:
                    self._timing = False
            if self._later:
                self._run_later("after_run", step)
        finally:
            self._later, self._current = outer

    def _start(self) -> float | None:
        """When a hook's event starts (None: not timed, or inside another timed event,
        such as a save's `sync()` delivering late hooks: it counts as the outer one's)."""
        if self._spent is None or self._timing:
            return None
        self._timing = True
        return time.perf_counter()

    def _took(self, hook: Hook | None, started: float | None) -> None:
        """A hook's event begun at `started` ends: its time goes to `hook`'s category."""
        if started is not None:
            self._timing = False
            if hook is not None:
                self._spent[self._categories[id(hook)]] += time.perf_counter() - started

    def _guard(self, hook: Hook) -> contextlib.AbstractContextManager:
        """Where `hook`'s run events run: guarded against host reads with `debug_host_syncs`
        when it is called on every run, else as they are."""
        where = self._guarded.get(id(hook)) if self._guarded else None
        return _AS_IS if where is None else self._syncs.guard(where)

    def after_read(self, step: int, values: list[tuple[Hook, dict[str, Any]]]) -> None:
        """Every `after_read` of one read of the accumulators, in list order."""
        for hook, hook_values in values:
            started = self._start()
            try:
                hook.after_read(step, hook_values)
            except Exception as error:
                self.failed(hook, "after_read", step, error)
            finally:
                self._took(hook, started)

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
        if self._raises(hook, error):
            error.add_note(f"(raised in {hook!r}.{event} at step {step})")
            raise error
        self._warn(hook, event, step, error)

    @staticmethod
    def _raises(hook: Hook, error: Exception) -> bool:
        """Whether `hook`'s `error` stops the run: its policy is to raise, or the error is control flow."""
        return (hook.on_error != "warn" or isinstance(error, StopIteration) or _errors.is_recoverable(error)
                or isinstance(error, (NanLossDuringTrainingError, HostSyncError)))

    def _warn(self, hook: Hook, event: str, step: int, error: Exception) -> None:
        """Logs the failure of a hook whose policy is to warn (its first few, then fewer)."""
        count = self._failures[id(hook)] = self._failures.get(id(hook), 0) + 1
        if count <= 3 or count in (10, 100) or count % 1000 == 0:
            logger.warning("%r.%s failed at step %d (failure %d; on_error='warn', so training goes on): %r",
                           hook, event, step, count, error, exc_info=count == 1)


def _has(hook: Hook, event: str) -> bool:
    """Whether `hook` does something on `event` (the base class's does nothing)."""
    return event in vars(hook) or getattr(type(hook), event) is not getattr(Hook, event)


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
