"""Preemption in the session: SIGTERM and SIGHUP save and stop, under `nohup` SIGHUP is
left ignored, and the handlers before come back at close."""

import signal

import jax.numpy as jnp
import pytest

import jaxmon as jm


def count(state, batch):
    return state + 1, {}


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP], ids=["sigterm", "sighup"])
def test_a_signal_asks_to_save_and_stop_and_says_which(signum):
    before = signal.getsignal(signum)
    with jm.MonitoredSession(count, state=jnp.zeros(())) as sess:
        sess.run({})
        assert not sess.should_stop() and sess.preemption_signal is None
        signal.raise_signal(signum)
        assert sess.should_stop() and sess.preemption_requested and sess.preemption_signal == signum
    assert signal.getsignal(signum) is before


def test_under_nohup_sighup_stays_ignored_and_the_run_goes_on():
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # as `nohup` starts a program
    try:
        with jm.MonitoredSession(count, state=jnp.zeros(())) as sess:
            assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
            signal.raise_signal(signal.SIGHUP)
            sess.run({})
            assert not sess.should_stop() and sess.preemption_signal is None
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGHUP, signal.SIG_DFL)
