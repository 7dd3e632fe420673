"""The hook runner's error policies in real sessions: a warn-policy hook that fails lets
training go on (its warnings rate-limited), a raise-policy hook stops the run with a note."""

import logging

import pytest
from helpers import RecordingHook, count_step, run_loop, zero

import jaxmon as jm


class FailingAfterRun(jm.Hook):
    def __init__(self, on_error="warn"):
        self.on_error = on_error
        self.failures = 0

    def after_run(self, ctx, values):
        self.failures += 1
        raise ValueError(f"broken at {values.step}")


def hook_warnings(caplog, hook):
    return [r for r in caplog.records if r.name == "jaxmon" and r.levelno == logging.WARNING
            and repr(hook) in r.getMessage()]


def test_a_warn_hook_failing_in_after_run_lets_training_go_on(caplog):
    hook = FailingAfterRun()
    record = RecordingHook()
    with caplog.at_level(logging.WARNING, logger="jaxmon"):
        with jm.MonitoredSession(count_step, zero, hooks=[hook, record]) as sess:
            for _ in range(5):
                sess.run()
    assert sess.step == 5 and hook.failures == 5
    assert record.calls["after_run"] == 5 and record.calls["end"] == 1
    warnings = hook_warnings(caplog, hook)
    assert warnings and "after_run" in warnings[0].getMessage() and "step 1" in warnings[0].getMessage()


def test_warnings_of_a_failing_warn_hook_are_rate_limited(caplog):
    hook = FailingAfterRun()
    with caplog.at_level(logging.WARNING, logger="jaxmon"):
        sess = jm.MonitoredSession(count_step, zero, hooks=[hook])
        for _ in range(50):
            sess.run()
    assert hook.failures == 50 and sess.step == 50
    assert 1 <= len(hook_warnings(caplog, hook)) <= 5


def test_a_raise_hook_failing_in_after_run_stops_with_a_note():
    hook = FailingAfterRun(on_error="raise")
    with pytest.raises(ValueError, match="broken at 1") as info:
        with jm.MonitoredSession(count_step, zero, hooks=[hook]) as sess:
            run_loop(sess)
    assert f"(raised in {hook!r}.after_run at step 1)" in getattr(info.value, "__notes__", [])
    assert sess.step == 1


def test_the_default_policy_is_raise():
    assert jm.Hook.on_error == "raise" and FailingAfterRun("raise").on_error == "raise"


def test_a_bogus_policy_is_rejected_when_the_session_is_built():
    class Bogus(jm.Hook):
        on_error = "bogus"

    with pytest.raises(ValueError, match="bogus"):
        jm.MonitoredSession(count_step, zero, hooks=[Bogus()])


def test_a_warn_hook_failing_in_before_run_sits_that_run_out(caplog):
    class FlakyBefore(jm.Hook):
        on_error = "warn"

        def __init__(self):
            self.after = []

        def before_run(self, ctx):
            if ctx.step == 1:
                raise RuntimeError("flaky")
            return jm.RunArgs(fetches="value")

        def after_run(self, ctx, values):
            self.after.append((values.step, int(values.results)))

    hook = FlakyBefore()
    with caplog.at_level(logging.WARNING, logger="jaxmon"):
        sess = jm.MonitoredSession(count_step, zero, hooks=[hook])
        for _ in range(4):
            sess.run()
    assert sess.step == 4 and hook.after == [(1, 1), (3, 3), (4, 4)]
    assert any("before_run" in r.getMessage() and "step 1" in r.getMessage() for r in hook_warnings(caplog, hook))


def test_a_periodic_hook_with_warn_policy_keeps_training(caplog):
    def fn(session):
        raise OSError("disk full")

    hook = jm.PeriodicHook(fn, every_n_steps=2, on_error="warn")
    with caplog.at_level(logging.WARNING, logger="jaxmon"):
        with jm.MonitoredSession(count_step, zero, hooks=[hook, jm.StopAtStepHook(last_step=6)]) as sess:
            run_loop(sess)
    assert sess.step == 6 and len(hook_warnings(caplog, hook)) == 3


def test_stop_iteration_from_a_warn_hook_still_ends_the_session_cleanly():
    class Ender(jm.Hook):
        on_error = "warn"

        def after_run(self, ctx, values):
            if values.step == 3:
                raise StopIteration

    record = RecordingHook()
    with jm.MonitoredSession(count_step, zero, hooks=[Ender(), record]) as sess:
        for _ in range(10):
            sess.run()
    assert sess.step == 3 and sess.should_stop() and record.calls["end"] == 1
