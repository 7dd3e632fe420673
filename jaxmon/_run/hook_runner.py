"""The hook runner: calls every hook's events in list order under its error policy,
sleeps hooks between their triggers, and delivers each run's values, late ones a run
later (the hooks that only report them: on the report thread, `report_thread`). A run's
requests are one immutable `RunPlan`; its values come back as one `RunResult` (see
`dispatch`)."""

from __future__ import annotations

import collections
import contextlib
import logging
import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, NamedTuple

from jaxmon._base import errors
from jaxmon._base.errors import NanLossDuringTrainingError
from jaxmon._base.fetches import normalize
from jaxmon._base.hook import Hook, RunArgs, RunContext, RunValues
from jaxmon._base.host import to_host
from jaxmon._base.schedule import Schedule, schedule_of, steps_to
from jaxmon._base.triggers import Trigger
from jaxmon._ops import report_thread
from jaxmon._ops.failures import Failures
from jaxmon._ops.host_syncs import HostSyncError, HostSyncs
from jaxmon._ops.time_spent import TimeSpent, category_of
from jaxmon._run.plan import QUIET, Call, RunPlan, RunResult

logger = logging.getLogger("jaxmon")


_AS_IS = contextlib.nullcontext()
#: A hook's trigger when it must be asked again at the next run.
_NOW = Trigger(step=0)
#: The most plans kept (a hook that asks something new at every trigger would grow them).
MAX_PLANS = 64


class _Slot(NamedTuple):
    """A hook as the runner calls it: its place in the list, its schedule, which of its run
    events do something, whether its late `after_run` only reports (on the report thread),
    the category its time goes to, and, with `debug_host_syncs` for a hook called on every
    run, the words of a host read's error in its run events (None: not guarded)."""

    hook: Hook
    index: int
    schedule: Schedule
    before: bool
    after: bool
    reports: bool
    category: str
    guard: str | None


class HookRunner:
    """Calls every hook's events in list order and applies each hook's `on_error`.

    A hook's `next_trigger` says until when it sleeps: a run that ends before every
    hook's trigger calls no hook (`QUIET`). The same awake hooks asking the same give the
    same `RunPlan`, made once (the one thing kept between trigger runs). Runs whose hooks
    asked for late delivery wait in a queue until the next run was dispatched (or until
    `deliver_late()`); there, the `after_run`s that only report (`report_thread.reports`)
    go to the report thread, whose failures go to the session's `failures`.

    Args:
      hooks: the session's hooks.
      host_syncs: with `debug_host_syncs`, the guard the events of the hooks called on
        every run (no `next_trigger`) run under.
      spent: the session's seconds by category: each hook's events add to its own.
      failures: the session's failures found off the loop (a report on the report thread).
    """

    def __init__(self, hooks: Iterable[Hook] | None, host_syncs: HostSyncs | None = None,
                 spent: TimeSpent | None = None, failures: Failures | None = None):
        self.hooks = _check_hooks(() if hooks is None else hooks)
        self._failures = Failures() if failures is None else failures
        # The session's clocks, and the category of each hook's time.
        self._spent = TimeSpent() if spent is None else spent
        self._timing = False  # an event is being timed
        self._syncs = host_syncs if host_syncs is not None and host_syncs.enabled else None
        self._slots = [_slot(hook, i, self._syncs is not None) for i, hook in enumerate(self.hooks)]
        self._slot_of = {id(slot.hook): slot for slot in self._slots}  # a hook's slot, for what names the hook
        self._sleepers = [i for i, slot in enumerate(self._slots) if slot.schedule.next is not None]
        self._awake = any(slot.schedule.next is None and (slot.before or slot.after) for slot in self._slots)
        self._wake = [_NOW] * len(self._slots)  # each hook's next trigger, as it last said
        self._plans: dict[tuple, RunPlan] = {}  # by what the awake hooks asked
        # Runs that end before this step, while every clock is before its time, call no hook.
        self._quiet_step, self._deadlines = 0, []
        self._late: collections.deque = collections.deque()
        self._warnings = [0] * len(self._slots)  # failures of each warn-policy hook, for the log
        # What hooks asked to do once every hook's current event is done (see `later`),
        # and the hook whose event is running; None outside events.
        self._later: list[tuple[Hook | None, Callable[[], Any]]] | None = None
        self._current: Hook | None = None

    def begin(self, step: int) -> None:
        self._each("begin", step)

    def after_create_session(self, session: Any) -> None:
        self.reschedule()
        self._each("after_create_session", session.step, session)

    def end(self, session: Any) -> None:
        self._each("end", session.step, session)

    def reschedule(self) -> None:
        """Asks every hook its next trigger again at the next run (after a restore, or
        once a preemption makes a saver due now)."""
        self._wake, self._quiet_step = [_NOW] * len(self._slots), 0

    def _each(self, event: str, step: int, *args: Any) -> None:
        """Calls `event(*args)` of every hook in list order, under its error policy."""
        outer = self._open()
        try:
            for hook in self.hooks:
                self._current = hook
                try:
                    with self._timed(hook):
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
                with self._timed(hook):
                    fn()
            except Exception as error:
                if hook is None:
                    raise
                self.failed(hook, event, step, error)

    def run_limit(self, step: int, limit: int) -> int:
        """`limit`, cut to the next step some hook must end a run on. A sleeping hook's
        trigger is the one it last gave (its state changes only in its own events)."""
        for slot, trigger in zip(self._slots, self._wake, strict=True):
            schedule = slot.schedule
            if schedule.cut is None:
                continue
            steps = schedule.cut(step) if schedule.next is None or trigger.step <= step else steps_to(trigger, step)
            if steps is not None and steps < limit:
                limit = steps
        return limit

    def next_event(self) -> tuple[float, float]:
        """`(step, time)`: the step of the next run that calls a hook (at most the current
        step: the next run; inf: none), and the earliest time on its clock at which a
        sleeping hook wakes (inf: none). Several processes agree on these."""
        return self._quiet_step, min((deadline for _, deadline in self._deadlines), default=math.inf)

    def before_run(self, session: Any, step: int, *, steps: int, fetches: Any, batch: Any,
                   wake: bool = False) -> RunPlan:
        """Every awake hook's `before_run` for the run of `steps` steps after `step`, as
        one plan; `QUIET` when every hook sleeps past it (see `Hook.next_trigger`) and
        nothing else (`wake`) needs them. `fetches` and `batch` are the caller's."""
        if not wake and step + steps < self._quiet_step:
            for clock, deadline in self._deadlines:
                if clock() >= deadline:
                    break
            else:
                return QUIET
        return self._plan(RunContext(step, session, RunArgs(fetches, batch), steps=steps))

    def _plan(self, ctx: RunContext) -> RunPlan:
        """The `before_run` of every hook awake for the run of `ctx`, as one plan: the one
        made before for the same requests, with this run's context and feeds."""
        calls, only_read, keeps, asked, feeds = [], [], [], [], []  # asked: what each awake hook asked, the plan's key
        for i, slot in enumerate(self._slots):
            if slot.schedule.next is not None and self._asleep(i, ctx):
                continue
            args = None
            if slot.before:
                try:
                    args = self._before_run(slot, ctx)
                except Exception as error:
                    self.failed(slot.hook, "before_run", ctx.step, error)  # a warn-policy hook sits out
                    continue
            if args is None:
                if slot.after:
                    calls.append(Call(slot.hook))
                    asked.append(i)
                continue
            fetches = None if args.fetches is None else normalize(args.fetches, slot.hook)
            if fetches is None and not slot.after:  # nothing to call after the run: it feeds or reads
                if args.read:
                    only_read.append(slot.hook)
            else:
                calls.append(Call(slot.hook, args.late, fetches, args.read, slot.reports and args.late))
            if args.read and not args.restart:
                keeps.append(slot.hook)
            asked.append((i, args.late, None if fetches is None else fetches.key, args.read, args.restart))
            if args.feeds:
                feeds.append((slot.hook, args.feeds))
        if not asked:
            return RunPlan(ctx)
        key = tuple(asked)
        plan = self._plans.get(key)
        if plan is None:
            if len(self._plans) >= MAX_PLANS:
                self._plans.clear()
            plan = self._plans[key] = RunPlan.of(None, calls, only_read=only_read, keeps=keeps)
        return plan._replace(ctx=ctx, feeds=tuple(feeds))

    def _asleep(self, i: int, ctx: RunContext) -> bool:
        """Whether the sleeping hook numbered `i` sleeps through the run of `ctx`: the run
        ends before its trigger's step and its clock is before the trigger's time. A hook
        is asked its trigger once after each run that called it (and when told to
        `reschedule`), not again before the run it names."""
        trigger = self._wake[i]
        if trigger is _NOW:
            trigger = self._wake[i] = self._slots[i].schedule.next(ctx.step) or _NOW
        return ctx.next_step < trigger.step and (trigger.clock is None or trigger.clock() < trigger.time)

    def _before_run(self, slot: _Slot, ctx: RunContext) -> RunArgs | None:
        """`slot`'s hook's `before_run`, timed (and guarded), its answer checked."""
        with self._timed(slot.hook), self._guard(slot.hook):
            args = slot.hook.before_run(ctx)
        return None if args is None else _check_run_args(args, slot.hook)

    def after_run(self, plan: RunPlan, result: RunResult, step: int, read: Any = None) -> Any:
        """Delivers the previous run's late `after_run`s, queues this run's, then calls
        this run's other `after_run`s with their values; returns the caller's fetches
        on the host. One host read serves the caller and every hook called now.

        Args:
          plan: the run's plan.
          result: the run's result.
          step: the step number after the run.
          read: the run's read of the accumulators (`accumulators.Read`), if any hook read.
        """
        if self._late:
            self.deliver_late()  # the previous run's: the device already has this one queued
        if plan is QUIET:
            return None
        if plan.late or plan.away or read:  # a read's `after_read`s are late too
            self._late.append((plan, result.outputs, step, read, result.results))
        caller, fetched, now = result.caller, None, plan.now
        if caller is not None or (result.results and any(result.results[i] is not None for i in now)):
            caller, host = to_host((caller, [result.results[i] if result.results else None for i in now]))
            fetched = dict(zip(now, host, strict=True))
        if now:
            self._call_after_run(plan, now, results=fetched, outputs=result.outputs, step=step, read=read)
        self._settle(step)
        if not self._late:  # else with the late ones, after the next run's step: one wake-up of the thread
            report_thread.flush()  # the run's reports to the report thread
        return caller

    def _settle(self, step: int) -> None:
        """After a run's events: until which step (and time) every hook sleeps, so that
        the runs before it are quiet. A hook due at the next run is asked its trigger."""
        quiet, deadlines = 0 if self._awake else math.inf, []
        for i in self._sleepers:
            trigger = self._wake[i]
            if step + 1 >= trigger.step or (trigger.clock is not None and trigger.clock() >= trigger.time):
                trigger = self._wake[i] = self._slots[i].schedule.next(step) or _NOW
            quiet = min(quiet, trigger.step)
            if trigger.clock is not None and trigger.time != math.inf:
                deadlines.append((trigger.clock, trigger.time))
        self._quiet_step, self._deadlines = quiet, deadlines

    def deliver_late(self) -> None:
        """Calls the `after_run` of every run whose hooks asked for late delivery (those
        that only report: queued on the report thread)."""
        while self._late:
            plan, outputs, step, read, results = self._late.popleft()
            if read:
                self.after_read(read)  # on the loop
            if plan.away:
                report_thread.submit(self._report, plan, results, outputs, step, read)
            if plan.late:
                fetched = None  # no call fetched anything
                if results:
                    fetched = dict(zip(plan.late, to_host([results[i] for i in plan.late]), strict=True))
                self._call_after_run(plan, plan.late, results=fetched, outputs=outputs, step=step, read=read)
        report_thread.flush()

    def sync(self, step: int) -> None:
        """Delivers every late `after_run` and waits for the report thread; raises what
        failed off the loop (the session's step: `step`)."""
        self.deliver_late()
        report_thread.wait()
        self._failures.raise_first(step)

    def _report(self, plan: RunPlan, results: Any, outputs: Any, step: int, read: Any) -> None:
        """The `after_run`s of the calls of `plan` that only report, on the report thread."""
        for i in plan.away:
            call = plan.calls[i]
            try:
                fetched = results[i] if results else None
                accumulated = read.values(call.hook) if call.read and read else None
                call.hook.after_run(plan.ctx, RunValues(None if fetched is None else to_host(fetched), step,
                                                        outputs, accumulated))
            except Exception as error:
                if self._raises(call.hook, error):
                    error.add_note(f"(raised in {call.hook!r}.after_run at step {step}, on the report thread)")
                    self._failures.add_error(error)
                else:
                    self._warn(call.hook, "after_run", step, error)

    def _call_after_run(self, plan: RunPlan, indices: tuple[int, ...], *, results: Mapping[int, Any] | None,
                        outputs: Any, step: int, read: Any) -> None:
        """The `after_run` of the calls of `plan` numbered `indices`, with their `results` (None: none fetched)."""
        plain = RunValues(None, step, outputs)
        outer = self._open()
        try:
            for i in indices:
                call = plan.calls[i]
                accumulated = None
                if call.read and read is not None:
                    self.after_read(read)  # first: a NanHook finds a bad state before this hook acts on it
                    accumulated = read.values(call.hook)
                fetched = None if results is None else results[i]
                values = plain if fetched is None and accumulated is None else RunValues(
                    fetched, step, outputs, accumulated)
                self._current = call.hook
                try:
                    with self._timed(call.hook), self._guard(call.hook):
                        call.hook.after_run(plan.ctx, values)
                except Exception as error:
                    self.failed(call.hook, "after_run", step, error)
            self._run_later("after_run", step)
        finally:
            self._later, self._current = outer

    @contextlib.contextmanager
    def _timed(self, hook: Hook | None) -> Iterator[None]:
        """A hook's event: its time goes to `hook`'s category (none for a call no hook
        asked for). One inside another timed event, such as a save's `sync()` delivering
        late hooks, counts as the outer one's."""
        if self._timing:
            yield
            return
        self._timing = True
        try:
            with self._spent.timing(self._slot_of[id(hook)].category) if hook is not None else _AS_IS:
                yield
        finally:
            self._timing = False

    def _guard(self, hook: Hook) -> contextlib.AbstractContextManager:
        """Where `hook`'s run events run: guarded against host reads with `debug_host_syncs`
        when it is called on every run, else as they are."""
        where = self._slot_of[id(hook)].guard
        return _AS_IS if where is None else self._syncs.guard(where)

    def after_read(self, read: Any) -> None:
        """Every `after_read` of `read` (an `accumulators.Read`; None: no read), in list
        order, unless they were delivered already."""
        for hook, values in () if read is None else read.after_reads():
            try:
                with self._timed(hook):
                    hook.after_read(read.step, values)
            except Exception as error:
                self.failed(hook, "after_read", read.step, error)

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
        return (hook.on_error != "warn" or isinstance(error, StopIteration) or errors.is_recoverable(error)
                or isinstance(error, (NanLossDuringTrainingError, HostSyncError)))

    def _warn(self, hook: Hook, event: str, step: int, error: Exception) -> None:
        """Logs the failure of a hook whose policy is to warn (its first few, then fewer)."""
        index = self._slot_of[id(hook)].index
        self._warnings[index] += 1
        count = self._warnings[index]
        if count <= 3 or count in (10, 100) or count % 1000 == 0:
            logger.warning("%r.%s failed at step %d (failure %d; on_error='warn', so training goes on): %r",
                           hook, event, step, count, error, exc_info=count == 1)


def _slot(hook: Hook, index: int, guarded: bool) -> _Slot:
    """`hook`, the `index`-th, as the runner calls it; `guarded`: with `debug_host_syncs`."""
    schedule = schedule_of(hook)
    guard = None
    if guarded and schedule.next is None:
        guard = f"in {hook!r}, a hook called on every run (it has no next_trigger)"
    return _Slot(hook, index, schedule, _has(hook, "before_run"), _has(hook, "after_run"),
                 report_thread.reports_off_loop(hook), category_of(hook), guard)


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
        errors.check_on_error(hook, hook.on_error)
    return hooks


def _check_run_args(args: Any, hook: Hook) -> RunArgs:
    if not isinstance(args, RunArgs):
        raise TypeError(f"{hook!r}.before_run returned {args!r}; return jm.RunArgs(...) or None.")
    if args.feeds is not None and not isinstance(args.feeds, Mapping):
        raise TypeError(f"{hook!r}.before_run feeds {args.feeds!r}; feeds must be a dict {{key: value}}.")
    return args
