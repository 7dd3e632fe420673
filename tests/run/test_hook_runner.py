"""The hook runner on its own: events in list order, one `RunPlan` per run, hooks that
sleep until their trigger, values delivered now or a run late, `later`, the error
policies, and the runs a multi-step dispatch must end on. Fake hooks and a fake
session; each `RunResult` is built by hand (no dispatch, no compile)."""

from __future__ import annotations

import logging
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import FakeClock, RecordingHook, events

import jaxmon as jm
from jaxmon._base.fetches import Wanted
from jaxmon._run.hook_runner import QUIET, Call, HookRunner, RunResult

OUTPUTS = {"loss": jnp.float32(0.5)}


class FakeSession:
    """What the runner and the hooks use of a session: its step and `request_stop`."""

    def __init__(self, step=0):
        self.step, self.stops = step, 0

    def request_stop(self):
        self.stops += 1


SESSION = FakeSession()


def result(*results, caller=None):
    """A run's `RunResult`: no state, `OUTPUTS`, and the given per-call values."""
    return RunResult(None, OUTPUTS, caller, tuple(results))


def run(runner, step, length=1, results=(), caller=None):
    """One run after `step` as a session makes it (before_run, then after_run); its plan."""
    plan = runner.before_run(SESSION, step, steps=length, fetches=None, batch={})
    runner.after_run(plan, result(*results, caller=caller), step + length)
    return plan


class Asking(jm.Hook):
    """Returns `args` from before_run; logs (name, event, step) into `log`."""

    def __init__(self, name, log, args=None, on_error="raise"):
        self.name, self.log, self.args, self.on_error = name, log, args, on_error
        self.values = []

    def before_run(self, ctx):
        self.log.append((self.name, "before_run", ctx.step))
        return self.args

    def after_run(self, ctx, values):
        self.log.append((self.name, "after_run", values.step))
        self.values.append(values)

    def __repr__(self):
        return f"Asking({self.name!r})"


class Waking(jm.Hook):
    """Called only on runs that reach a multiple of `every` (its `next_trigger`); counts
    how often it was asked."""

    def __init__(self, every, log=None, exact=True):
        self.every, self.exact, self.log, self.asked = every, exact, [] if log is None else log, 0

    def next_trigger(self, step):
        self.asked += 1
        return jm.Trigger(step=(step // self.every + 1) * self.every, exact=self.exact)

    def before_run(self, ctx):
        self.log.append(("before_run", ctx.next_step))

    def after_run(self, ctx, values):
        self.log.append(("after_run", values.step))


# -- events and plans -----------------------------------------------------------------------


def test_every_event_goes_to_the_hooks_in_list_order():
    log = []
    hooks = [RecordingHook("a", log), RecordingHook("b", log), RecordingHook("c", log)]
    runner = HookRunner(hooks)
    runner.begin(0)
    runner.after_create_session(SESSION)
    run(runner, 0)
    runner.end(SESSION)
    for event in ("begin", "after_create_session", "before_run", "after_run", "end"):
        assert events(log, event) == ["a", "b", "c"]
    assert [e for _, e in log[::3]] == ["begin", "after_create_session", "before_run", "after_run", "end"]
    assert hooks[0].sessions == [SESSION]


def test_before_run_plans_each_hook_that_has_an_after_run_with_its_request_normalised():
    log = []
    fetching = Asking("fetching", log, jm.RunArgs(fetches="loss", feeds={"k": 1}, late=True, read=True))
    plain = Asking("plain", log)  # asks nothing: called with plain values
    listing = Asking("listing", log, jm.RunArgs(fetches=["loss", "acc"]))

    class FeedOnly(jm.Hook):  # no after_run: no call, but its feeds count
        def before_run(self, ctx):
            return jm.RunArgs(feeds={"j": 2})

    feeder = FeedOnly()
    runner = HookRunner([fetching, plain, jm.Hook(), feeder, listing])
    batch = {"x": 1}
    plan = runner.before_run(SESSION, 4, steps=2, fetches=["caller"], batch=batch)
    hooks = [call.hook for call in plan.calls]
    assert jm.Hook not in map(type, hooks)  # the bare Hook does nothing: no call
    first, second, third = (call for call in plan.calls if call.hook is not feeder)
    assert [first.hook, second.hook, third.hook] == [fetching, plain, listing]
    assert first == Call(fetching, True, {"loss": "loss"}, True)
    assert isinstance(first.fetches, Wanted) and first.fetches.shape == ("one", "loss")
    assert second == Call(plain) and second.fetches is None and not second.late
    assert third.fetches.shape == ("list", ["loss", "acc"]) and not third.read
    assert plan.feeds == ((fetching, {"k": 1}), (feeder, {"j": 2}))
    assert plan.readers == (fetching,)
    ctx = plan.ctx
    assert (ctx.step, ctx.steps, ctx.next_step) == (4, 2, 6)
    assert ctx.original_args.fetches == ["caller"] and ctx.original_args.feeds is batch
    assert [name for name, *_ in log] == ["fetching", "plain", "listing"]


def test_a_before_run_that_returns_no_run_args_or_bad_feeds_is_named():
    runner = HookRunner([Asking("bad", [], args={"fetches": "loss"})])
    with pytest.raises(TypeError, match=r"Asking\('bad'\).before_run returned \{'fetches': 'loss'\}"):
        runner.before_run(SESSION, 0, steps=1, fetches=None, batch={})
    runner = HookRunner([Asking("feeds", [], args=jm.RunArgs(feeds=[1]))])
    with pytest.raises(TypeError, match=r"feeds \[1\]; feeds must be a dict"):
        runner.before_run(SESSION, 0, steps=1, fetches=None, batch={})


def test_hooks_must_be_a_list_of_hooks_with_a_valid_policy():
    with pytest.raises(TypeError, match="got a single"):
        HookRunner(jm.Hook())
    with pytest.raises(TypeError, match=r"hooks\[1\] is 3 of type int"):
        HookRunner([jm.Hook(), 3])
    with pytest.raises(ValueError, match="on_error must be 'raise'"):
        HookRunner([Asking("x", [], on_error="ignore")])
    assert HookRunner(None).hooks == ()


# -- sleeping hooks ---------------------------------------------------------------------------


def test_a_hook_sleeps_until_its_step_and_runs_it_sleeps_through_are_quiet():
    hook = Waking(every=5)
    runner = HookRunner([hook])
    plans = [run(runner, step) for step in range(12)]
    assert hook.log == [("before_run", 5), ("after_run", 5), ("before_run", 10), ("after_run", 10)]
    quiet = [step + 1 for step, plan in enumerate(plans) if plan is QUIET]
    assert quiet == [2, 3, 4, 6, 7, 8, 9, 11, 12]  # the first run asks its trigger (5): not quiet, no call
    assert plans[0].calls == () and plans[0] is not QUIET
    assert runner.next_event() == (15, float("inf"))


def test_a_hook_is_called_at_the_trigger_it_gave_after_its_last_event_and_asked_once_per_trigger():
    class Relative(Waking):
        """Acts `every` steps after the step it was last asked at: asking it again before
        its trigger would move the trigger on forever."""

        def next_trigger(self, step):
            self.asked += 1
            return jm.Trigger(step=step + self.every)

    hook = Relative(every=3)
    runner = HookRunner([hook])
    plans = [run(runner, step) for step in range(12)]
    assert [step for event, step in hook.log if event == "after_run"] == [3, 6, 9, 12]
    assert sum(plan is QUIET for plan in plans) == 7  # the first run asks; two runs of three sleep
    assert hook.asked == 5  # the first run, then once after each run it acted on
    same = Waking(every=5)
    runner = HookRunner([same])
    for step in range(20):
        run(runner, step)
    assert same.asked == 5  # not again on the run that reaches its trigger


def test_a_plan_is_quiet_only_when_every_hook_sleeps():
    sleeper, awake = Waking(every=10), Asking("awake", [])
    runner = HookRunner([sleeper, awake])
    plans = [run(runner, step) for step in range(4)]
    assert all(plan is not QUIET for plan in plans)
    assert [[call.hook for call in plan.calls] for plan in plans] == [[awake]] * 4
    assert runner.next_event()[0] == 0  # a hook called every run: the next run calls a hook


def test_wake_calls_every_awake_hook_on_a_run_the_hooks_sleep_through():
    hook = Waking(every=5)
    runner = HookRunner([hook])
    run(runner, 0)
    assert run(runner, 1) is QUIET
    plan = runner.before_run(SESSION, 2, steps=1, fetches=["loss"], batch={}, wake=True)  # the caller fetches
    assert plan is not QUIET and plan.calls == () and plan.ctx.step == 2


def test_a_seconds_trigger_wakes_the_hook_once_its_clock_reaches_the_time():
    clock = FakeClock(1000.0)

    class Timed(jm.Hook):
        def __init__(self):
            self.last, self.steps = None, []

        def next_trigger(self, step):
            return None if self.last is None else jm.Trigger(time=self.last + 10, clock=clock)

        def after_run(self, ctx, values):
            self.last = clock()
            self.steps.append(values.step)

    hook = Timed()
    runner = HookRunner([hook])
    run(runner, 0)
    assert [run(runner, step) is QUIET for step in (1, 2)] == [True, True]
    assert runner.next_event() == (float("inf"), 1010.0)
    clock.t = 1010.0
    assert run(runner, 3) is not QUIET
    clock.t = 1015.0
    assert run(runner, 4) is QUIET
    assert hook.steps == [1, 4]


def test_reschedule_makes_every_hook_be_asked_its_trigger_again():
    hook = Waking(every=100)
    runner = HookRunner([hook])
    run(runner, 0)
    asked = hook.asked
    assert run(runner, 1) is QUIET and hook.asked == asked  # sleeping: not asked
    hook.every = 3  # its trigger moved: only a reschedule asks again
    runner.reschedule()
    assert runner.next_event()[0] == 0
    run(runner, 2)
    assert hook.asked > asked
    assert hook.log == [("before_run", 3), ("after_run", 3)]


def test_after_create_session_reschedules():
    hook = Waking(every=100)
    runner = HookRunner([hook])
    run(runner, 0)
    assert run(runner, 1) is QUIET
    runner.after_create_session(FakeSession(50))
    assert runner.next_event()[0] == 0 and run(runner, 2) is not QUIET


# -- values, now and late ----------------------------------------------------------------------


def test_after_run_delivers_host_values_in_their_structure_and_returns_the_callers():
    log = []
    one = Asking("one", log, jm.RunArgs(fetches="loss"))
    listed = Asking("list", log, jm.RunArgs(fetches=["loss", "acc"]))
    named = Asking("dict", log, jm.RunArgs(fetches={"l": "loss"}))
    plain = Asking("plain", log)
    runner = HookRunner([one, listed, named, plain])
    plan = runner.before_run(SESSION, 6, steps=1, fetches="loss", batch={})
    values = (jnp.float32(1.5), [jnp.float32(1.5), jnp.arange(3)], {"l": jnp.float32(1.5)}, None)
    caller = runner.after_run(plan, result(*values, caller=jnp.float32(1.5)), 7)
    assert isinstance(caller, np.ndarray) and not isinstance(caller, jax.Array) and caller == 1.5
    assert one.values[0].results == 1.5 and isinstance(one.values[0].results, np.ndarray)
    first, second = listed.values[0].results
    assert isinstance(second, np.ndarray) and not isinstance(second, jax.Array) and second.tolist() == [0, 1, 2]
    assert list(named.values[0].results) == ["l"] and isinstance(named.values[0].results["l"], np.ndarray)
    assert plain.values[0].results is None and plain.values[0].accumulated is None
    for hook in (one, listed, named, plain):
        assert hook.values[0].step == 7 and hook.values[0].outputs is OUTPUTS
    assert [name for name, event, _ in log if event == "after_run"] == ["one", "list", "dict", "plain"]


def test_a_quiet_run_calls_no_hook_and_returns_nothing():
    hook = Waking(every=5)
    runner = HookRunner([hook])
    run(runner, 0)
    plan = runner.before_run(SESSION, 1, steps=1, fetches=None, batch={})
    assert plan is QUIET and plan.ctx is None and plan.readers == ()
    assert runner.after_run(plan, result(), 2) is None
    assert hook.log == []


def test_late_calls_wait_for_the_next_after_run_and_come_before_its_own():
    log = []
    late = Asking("late", log, jm.RunArgs(fetches="loss", late=True))
    now = Asking("now", log, jm.RunArgs(fetches="loss"))
    runner = HookRunner([late, now])
    first = runner.before_run(SESSION, 0, steps=1, fetches=None, batch={})
    runner.after_run(first, result(jnp.float32(1.0), jnp.float32(1.0)), 1)
    assert [(n, e) for n, e, _ in log] == [("late", "before_run"), ("now", "before_run"), ("now", "after_run")]
    log.clear()
    second = runner.before_run(SESSION, 1, steps=1, fetches=None, batch={})
    runner.after_run(second, result(jnp.float32(2.0), jnp.float32(2.0)), 2)
    assert log == [("late", "before_run", 1), ("now", "before_run", 1), ("late", "after_run", 1),
                   ("now", "after_run", 2)]
    assert float(late.values[0].results) == 1.0 and isinstance(late.values[0].results, np.ndarray)
    assert late.values[0].step == 1
    log.clear()
    runner.deliver_late()  # the second run's late call, without a third run
    assert log == [("late", "after_run", 2)] and float(late.values[1].results) == 2.0
    runner.deliver_late()
    assert len(late.values) == 2  # delivered once


def test_late_calls_are_delivered_by_a_quiet_run_too():
    log = []
    late = Asking("late", log, jm.RunArgs(late=True))
    runner = HookRunner([late])
    plan = runner.before_run(SESSION, 0, steps=1, fetches=None, batch={})
    runner.after_run(plan, result(), 1)
    assert ("late", "after_run", 1) not in log
    runner.after_run(QUIET, result(), 2)
    assert log[-1] == ("late", "after_run", 1) and late.values[0].results is None


def test_later_runs_after_every_hooks_after_run_of_that_run():
    log = []

    class Deferring(Asking):
        def after_run(self, ctx, values):
            super().after_run(ctx, values)
            runner.later(lambda: log.append(("later", values.step)))

    first, second = Deferring("first", log), Asking("second", log)
    runner = HookRunner([first, second])
    run(runner, 0)
    assert log[2:] == [("first", "after_run", 1), ("second", "after_run", 1), ("later", 1)]
    called = []
    runner.later(lambda: called.append(True))  # outside any event: now
    assert called == [True]


def test_later_in_after_create_session_runs_after_every_hooks_event():
    log = []

    class Saving(jm.Hook):
        def after_create_session(self, session):
            runner.later(lambda: log.append("save"))

    class Other(jm.Hook):
        def after_create_session(self, session):
            log.append("other")

    runner = HookRunner([Saving(), Other()])
    runner.after_create_session(SESSION)
    assert log == ["other", "save"]


# -- error policies -------------------------------------------------------------------------------


class Failing(Asking):
    def after_run(self, ctx, values):
        super().after_run(ctx, values)
        raise ValueError(f"{self.name} broke")


def test_a_warn_hook_that_fails_is_logged_and_the_hooks_after_it_still_run(caplog):
    log = []
    warn, after = Failing("warn", log, on_error="warn"), Asking("after", log)
    runner = HookRunner([warn, after])
    with caplog.at_level(logging.WARNING, logger="jaxmon"):
        run(runner, 0)
        run(runner, 1)
    assert events([(n, e) for n, e, _ in log], "after_run") == ["warn", "after", "warn", "after"]
    assert "Asking('warn').after_run failed at step 1 (failure 1; on_error='warn'" in caplog.text
    assert "failure 2" in caplog.text and "warn broke" in caplog.text


def test_a_warn_hook_whose_before_run_fails_sits_out_that_run(caplog):
    class BadBefore(Asking):
        def before_run(self, ctx):
            raise ValueError("no plan")

    bad = BadBefore("bad", [], on_error="warn")
    runner = HookRunner([bad])
    with caplog.at_level(logging.WARNING, logger="jaxmon"):
        plan = runner.before_run(SESSION, 3, steps=1, fetches=None, batch={})
    assert plan.calls == () and "Asking('bad').before_run failed at step 3" in caplog.text


def test_a_raise_hooks_error_gets_a_note_naming_the_hook_the_event_and_the_step():
    runner = HookRunner([Failing("loud", [])])
    plan = runner.before_run(SESSION, 41, steps=1, fetches=None, batch={})
    with pytest.raises(ValueError, match="loud broke") as raised:
        runner.after_run(plan, result(), 42)
    assert raised.value.__notes__ == ["(raised in Asking('loud').after_run at step 42)"]


def test_a_warn_hook_still_raises_a_nan_loss_error_and_a_recoverable_one():
    class Raising(jm.Hook):
        on_error = "warn"

        def after_run(self, ctx, values):
            raise self.error

    hook = Raising()
    runner = HookRunner([hook])
    for error in (jm.NanLossDuringTrainingError("nan"), jm.AbortedError("peer restarted")):
        hook.error = error
        with pytest.raises(type(error)) as raised:
            run(runner, 0)
        assert raised.value.__notes__[-1] == "(raised in Raising().after_run at step 1)"


def test_a_later_fn_that_fails_falls_under_the_policy_of_the_hook_that_asked(caplog):
    class Deferring(jm.Hook):
        def __init__(self, on_error):
            self.on_error = on_error

        def after_run(self, ctx, values):
            runner.later(self.fail)

        def fail(self):
            raise OSError("disk full")

    runner = HookRunner([Deferring("warn")])
    with caplog.at_level(logging.WARNING, logger="jaxmon"):
        run(runner, 0)
    assert "Deferring().after_run failed at step 1" in caplog.text
    runner = HookRunner([Deferring("raise")])
    with pytest.raises(OSError, match="disk full") as raised:
        run(runner, 0)
    assert raised.value.__notes__ == ["(raised in Deferring().after_run at step 1)"]


# -- multi-step runs --------------------------------------------------------------------------------


def test_run_limit_cuts_at_the_nearest_exact_trigger_and_ignores_inexact_ones():
    runner = HookRunner([Waking(every=10), Waking(every=4, exact=False), Waking(every=16)])
    assert runner.run_limit(3, 32) == 7  # 10 - 3; the inexact trigger at 4 does not cut
    assert runner.run_limit(12, 32) == 4  # the step-16 trigger, before step 20
    assert runner.run_limit(0, 8) == 8  # no trigger before the limit
    assert HookRunner([Waking(every=4, exact=False)]).run_limit(1, 32) == 32
    assert HookRunner([Asking("every run", [])]).run_limit(0, 32) == 32


def test_a_multi_step_run_calls_a_hook_whose_trigger_falls_inside_it():
    hook = Waking(every=20, exact=False)
    runner = HookRunner([hook])
    plans = [run(runner, step, length=8) for step in (0, 8, 16, 24, 32)]
    assert [plan is QUIET for plan in plans] == [False, True, False, True, False]
    assert hook.log == [("before_run", 24), ("after_run", 24), ("before_run", 40), ("after_run", 40)]


# -- older hooks and subclasses of built-in ones --------------------------------------------------


class Legacy(jm.Hook):
    """Written against the older members, a timer and idle between its triggers, which no
    longer schedule anything: no `next_trigger`, so it is called on every run."""

    idle_between_triggers = True

    def __init__(self, every):
        self.timer, self.before, self.after = jm.SecondOrStepTimer(every_steps=every), [], []

    def before_run(self, ctx):
        self.before.append(ctx.next_step)
        self.timer.due(ctx.next_step)

    def after_run(self, ctx, values):
        self.after.append(values.step)


def test_a_hook_with_the_older_timer_members_is_called_on_every_run():
    hook = Legacy(every=3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no deprecation shim, no warning
        runner = HookRunner([hook])
    plans = [run(runner, step) for step in range(10)]
    assert hook.before == hook.after == list(range(1, 11))
    assert not any(plan is QUIET for plan in plans)
    assert runner.run_limit(10, 32) == 32  # its timer puts no bound on a run's length


def test_a_hook_with_next_trigger_gives_no_deprecation_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        HookRunner([Waking(every=3), jm.StepCounterHook(every_n_steps=10)])


def test_a_subclass_of_a_built_in_hook_that_replaces_after_run_is_called_every_run():
    class Counting(jm.StepCounterHook):
        def __init__(self):
            super().__init__(every_n_steps=10)
            self.steps = []

        def after_run(self, ctx, values):
            self.steps.append(values.step)
            super().after_run(ctx, values)

    counting, plain = Counting(), jm.StepCounterHook(every_n_steps=10)
    runner = HookRunner([counting])
    plans = [run(runner, step) for step in range(12)]
    assert counting.steps == list(range(1, 13)) and QUIET not in plans
    assert runner.run_limit(12, 32) == 8  # its next trigger (20) still ends multi-step runs
    runner = HookRunner([plain])  # the built-in hook itself sleeps between its triggers
    plans = [run(runner, step) for step in range(12)]
    # awake for its first run (which starts its clock), then asleep until its trigger at step 10
    assert [step + 1 for step, plan in enumerate(plans) if plan is not QUIET] == [1, 10]


# -- close -------------------------------------------------------------------------------------------


def test_close_calls_every_hook_and_raises_the_first_error_after():
    closed = []

    class Closing(jm.Hook):
        def __init__(self, name, error=None, on_error="raise"):
            self.name, self.error, self.on_error = name, error, on_error

        def close(self):
            closed.append(self.name)
            if self.error:
                raise self.error

        def __repr__(self):
            return f"Closing({self.name!r})"

    hooks = [Closing("a", OSError("a")), Closing("b", OSError("b")), Closing("c")]
    with pytest.raises(OSError, match="a") as raised:
        HookRunner(hooks).close(raise_errors=True)
    assert closed == ["a", "b", "c"] and raised.value.__notes__ == ["(raised in Closing('a').close)"]
    closed.clear()
    HookRunner(hooks).close(raise_errors=False)  # logged only
    HookRunner([Closing("w", OSError("w"), on_error="warn")]).close(raise_errors=True)
    assert closed == ["a", "b", "c", "w"]


def test_after_read_goes_to_each_hook_under_its_policy(caplog):
    got = []

    class Reading(jm.Hook):
        def __init__(self, on_error="raise"):
            self.on_error = on_error

        def after_read(self, step, values):
            got.append((step, values))
            if self.on_error == "warn":
                raise ValueError("bad read")

    class Read:  # an `accumulators.Read` of step 5, delivered once
        step, told = 5, False

        def after_reads(self):
            told, self.told = self.told, True
            return [] if told else [(a, {"m": 1.0}), (b, {"m": 2.0})]

    a, b, read = Reading("warn"), Reading(), Read()
    runner = HookRunner([a, b])
    with caplog.at_level(logging.WARNING, logger="jaxmon"):
        runner.after_read(read)
        runner.after_read(read)
    assert got == [(5, {"m": 1.0}), (5, {"m": 2.0})] and "after_read failed at step 5" in caplog.text
