"""Recovery from preemption errors: the state re-created and the run retried, in the step,
the data or `init_fn`, up to `max_recoveries`; other errors are not recovered."""

import jax
import pytest
from helpers import RecordingHook, count_step, zero

import jaxmon as jm


@pytest.mark.parametrize("error", [jm.AbortedError, jm.UnavailableError])
def test_a_preemption_error_re_creates_the_state_and_retries(error):
    hook = RecordingHook(raise_in={"before_run": (4, error("preempted"))})
    sess = jm.MonitoredSession(count_step, zero, hooks=[hook])
    assert [int(sess.run(fetches="value")) for _ in range(3)] == [1, 2, 3]
    assert int(sess.run(fetches="value")) == 1  # re-initialised, then retried
    assert sess.step == 1 and not sess.should_stop()
    assert hook.calls["begin"] == 1 and hook.calls["after_create_session"] == 2
    assert hook.calls["before_run"] == 5 and hook.calls["after_run"] == 4
    assert hook.sessions == [sess, sess]


def test_a_failing_init_fn_is_retried_at_creation():
    calls = []

    def init_fn():
        calls.append(1)
        if len(calls) == 1:
            raise jm.AbortedError("not yet")
        return zero()

    sess = jm.MonitoredSession(count_step, init_fn)
    assert len(calls) == 2 and sess.step == 0 and int(sess.state) == 0


def test_a_jax_runtime_abort_inside_the_step_is_recovered():
    hook = RecordingHook(raise_in={"after_run": (2, jax.errors.JaxRuntimeError("ABORTED: lost peer"))})
    sess = jm.MonitoredSession(count_step, zero, hooks=[hook])
    sess.run()
    sess.run()
    assert sess.step == 1 and hook.calls["after_create_session"] == 2


def test_an_abort_raised_inside_the_step_function_is_recovered():
    traces = []

    def aborts_on_its_first_trace(state, batch):
        traces.append(1)
        if len(traces) == 1:
            raise jm.UnavailableError("device not ready")
        return count_step(state, batch)

    hook = RecordingHook()
    sess = jm.MonitoredSession(aborts_on_its_first_trace, zero, hooks=[hook])
    assert int(sess.run(fetches="value")) == 1
    assert hook.calls["after_create_session"] == 2 and sess.compile_count == 1


def test_an_abort_from_the_data_is_retried_without_losing_a_batch():
    def data():
        yield 1
        raise jm.AbortedError("input service restarted")

    class Retrying:
        def __init__(self):
            self.inner, self.items = data(), iter([2, 3])

        def __iter__(self):
            return self

        def __next__(self):
            try:
                return next(self.inner)
            except jm.AbortedError:
                self.inner = self.items
                raise

    def add(state, batch):
        return state + batch, {"value": state + batch}

    sess = jm.MonitoredSession(add, zero, data=Retrying())
    assert [int(sess.run(fetches="value")) for _ in range(2)] == [1, 2]  # re-initialised: 0 + 2


def test_recovery_gives_up_after_max_recoveries():
    class AlwaysAborts(jm.Hook):
        def before_run(self, ctx):
            raise jm.AbortedError("always")

    hook = RecordingHook()
    sess = jm.MonitoredSession(count_step, zero, hooks=[hook, AlwaysAborts()], max_recoveries=2)
    with pytest.raises(jm.AbortedError, match="always"):
        sess.run()
    assert hook.calls["after_create_session"] == 3 and hook.calls["before_run"] == 3


def test_non_preemption_errors_are_not_recovered():
    hook = RecordingHook(raise_in={"before_run": (1, ValueError("bad"))})
    sess = jm.MonitoredSession(count_step, zero, hooks=[hook])
    with pytest.raises(ValueError):
        sess.run()
    assert hook.calls["after_create_session"] == 1


def test_a_state_given_directly_cannot_be_re_created_and_says_so():
    hook = RecordingHook(raise_in={"before_run": (1, jm.AbortedError("preempted"))})
    sess = jm.MonitoredSession(count_step, state=zero(), hooks=[hook])
    with pytest.raises(jm.AbortedError) as info:
        sess.run()
    assert any("pass init_fn=" in note for note in info.value.__notes__)
