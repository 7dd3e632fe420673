"""Session lifecycle: creation, the end of a `with` block (clean, by an error, by the end of
the data), close, and the tracebacks errors keep."""

import traceback

import jax.numpy as jnp
import pytest
from helpers import RecordingHook, count_step, events, zero

import jaxmon as jm


def test_a_new_session_has_its_initialised_state_at_step_zero():
    sess = jm.MonitoredSession(count_step, zero)
    assert int(sess.state) == 0 and sess.step == 0 and not sess.should_stop()
    assert jm.MonitoredSession(count_step, state=jnp.asarray(4)).state == 4


def test_construction_calls_begin_then_init_then_after_create_session():
    log = []

    def init_fn():
        log.append(("init_fn", "called"))
        return zero()

    jm.MonitoredSession(count_step, init_fn, hooks=[RecordingHook("a", log), RecordingHook("b", log)])
    assert log == [("a", "begin"), ("b", "begin"), ("init_fn", "called"),
                   ("a", "after_create_session"), ("b", "after_create_session")]


def test_a_clean_with_exit_calls_end_in_order_and_closes():
    log = []
    with jm.MonitoredSession(count_step, zero, hooks=[RecordingHook("a", log), RecordingHook("b", log)]) as sess:
        sess.run()
    assert events(log, "end") == ["a", "b"] and log[-2:] == [("a", "end"), ("b", "end")]
    assert sess.should_stop()
    with pytest.raises(RuntimeError, match="Run called on a closed session"):
        sess.run()


def test_an_error_in_the_body_propagates_skips_end_and_closes():
    hook = RecordingHook()
    with pytest.raises(RuntimeError, match="body failed"):
        with jm.MonitoredSession(count_step, zero, hooks=[hook]) as sess:
            sess.run()
            raise RuntimeError("body failed")
    assert sess.should_stop() and "end" not in hook.calls


@pytest.mark.parametrize("source", ["hook", "data"])
def test_end_of_data_ends_the_with_block_cleanly(source):
    hook = RecordingHook(raise_in={"before_run": (2, StopIteration())} if source == "hook" else None)
    data = [jnp.ones(())] if source == "data" else None
    reached = []
    with jm.MonitoredSession(count_step, zero, data=data, hooks=[hook]) as sess:
        sess.run()
        reached.append(1)
        sess.run()
        reached.append(2)  # skipped: the second run ends the data
    assert reached == [1] and sess.should_stop() and sess.step == 1
    assert hook.calls["end"] == 1 and hook.calls["after_run"] == 1


def test_end_of_data_sets_should_stop_for_a_while_loop():
    with jm.MonitoredSession(count_step, zero, data=range(5)) as sess:
        while not sess.should_stop():
            sess.run()
    assert sess.step == 5


def test_an_error_in_a_hook_escapes_and_the_session_is_closed():
    hook = RecordingHook(raise_in={"after_run": (4, RuntimeError("hook failed"))})
    with pytest.raises(RuntimeError, match="hook failed"):
        with jm.MonitoredSession(count_step, zero, hooks=[hook]) as sess:
            for _ in range(10):
                sess.run()
    assert sess.step == 4 and sess.should_stop() and "end" not in hook.calls


def test_an_explicit_close_calls_end_once_and_a_second_close_is_harmless():
    hook = RecordingHook()
    sess = jm.MonitoredSession(count_step, zero, hooks=[hook])
    sess.run()
    sess.close()
    sess.close()
    assert hook.calls["end"] == 1 and sess.should_stop()
    assert int(sess.state) == 1  # the final state stays readable


def test_close_inside_the_with_block_is_reported_at_exit():
    hook = RecordingHook()
    with pytest.raises(RuntimeError, match="Session is already closed"):
        with jm.MonitoredSession(count_step, zero, hooks=[hook]) as sess:
            sess.close()
    assert hook.calls["end"] == 1


def raising_step(state, batch):
    raise ZeroDivisionError("raised by the step")


def test_errors_keep_their_own_traceback():
    sess = jm.MonitoredSession(raising_step, zero)
    with pytest.raises(ZeroDivisionError) as info:
        sess.run()
    assert traceback.extract_tb(info.value.__traceback__)[-1].name == "raising_step"

    hook = RecordingHook(raise_in={"before_run": (1, KeyError("from the hook"))})
    sess = jm.MonitoredSession(count_step, zero, hooks=[hook])
    with pytest.raises(KeyError) as info:
        sess.run()
    assert traceback.extract_tb(info.value.__traceback__)[-1].name == "_event"


def test_hooks_none_means_no_hooks():
    with jm.MonitoredSession(count_step, zero, hooks=None) as sess:
        sess.run()
    assert sess.step == 1


def test_step_is_a_host_int_counting_completed_runs():
    sess = jm.MonitoredSession(count_step, zero, initial_step=7)
    sess.run()
    assert sess.step == 8 and type(sess.step) is int
