"""PeriodicHook: a function called every N steps or seconds, and at the end."""

import pytest
from helpers import FakeTime, count_step, zero

import jaxmon as jm


def test_periodic_every_3_steps_calls_after_steps_3_6_9():
    calls, sessions = [], []

    def fn(session):
        calls.append(session.step)
        sessions.append(session)

    sess = jm.MonitoredSession(count_step, zero, hooks=[jm.PeriodicHook(fn, every_n_steps=3)])
    for _ in range(10):
        sess.run()
    sess.close()
    assert calls == [3, 6, 9] and all(s is sess for s in sessions)  # after steps N, 2N, ...


@pytest.mark.parametrize("runs, expected", [(9, [3, 6, 9]), (10, [3, 6, 9, 10])])
def test_periodic_at_end_calls_once_more_unless_the_last_step_was_just_called(runs, expected):
    calls = []
    sess = jm.MonitoredSession(count_step, zero, hooks=[
        jm.PeriodicHook(lambda s: calls.append(s.step), every_n_steps=3, at_end=True)])
    for _ in range(runs):
        sess.run()
    sess.close()
    assert calls == expected


def test_periodic_without_at_end_does_not_call_at_end():
    calls = []
    sess = jm.MonitoredSession(count_step, zero, hooks=[jm.PeriodicHook(lambda s: calls.append(s.step), 3)])
    for _ in range(11):
        sess.run()
    sess.close()
    assert calls == [3, 6, 9]


def test_periodic_every_n_secs_with_a_fake_clock():
    fake = FakeTime()
    calls = []
    hook = jm.PeriodicHook(lambda s: calls.append(s.step), every_n_secs=2.0, clock=fake.clock)
    sess = jm.MonitoredSession(count_step, zero, hooks=[hook])
    for _ in range(10):
        fake.advance(1.0)
        sess.run()
    assert calls == [2, 4, 6, 8, 10]  # 2 s after the session's start, then after each call


@pytest.mark.parametrize("args, kwargs, error", [
    ((print,), {}, ValueError),  # neither period
    ((print,), {"every_n_steps": 2, "every_n_secs": 1.0}, ValueError),  # both
    (("not a function",), {"every_n_steps": 2}, TypeError),
    ((print,), {"every_n_steps": 2, "on_error": "bogus"}, ValueError),
    ((print,), {"every_n_steps": 0}, ValueError),
])
def test_periodic_validates_its_arguments(args, kwargs, error):
    with pytest.raises(error):
        jm.PeriodicHook(*args, **kwargs)
