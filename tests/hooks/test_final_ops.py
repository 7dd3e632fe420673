"""FinalOpsHook: fetches computed once, on the last state and outputs of a session."""

import logging

import jax.numpy as jnp
import numpy as np
import pytest
from helpers import run_loop

import jaxmon as jm


def vector_step(state, batch):
    state = state + 1.0
    return state, {"loss": state.sum()}


def arange3():
    return jnp.arange(3.0)


def sum_of_squares(state, batch, outputs):
    return (state**2).sum()


def times_ten(state, batch, outputs):
    return state * 10.0


def test_final_ops_are_computed_on_the_last_state_and_outputs():
    hook = jm.FinalOpsHook({"scalar": sum_of_squares, "vector": times_ten, "out": "loss"})
    with jm.MonitoredSession(vector_step, arange3, hooks=[hook, jm.StopAtStepHook(last_step=2)]) as sess:
        run_loop(sess)
        assert hook.final_values is None  # not before end
    # After 2 steps the state is [2, 3, 4].
    values = hook.final_values
    assert set(values) == {"scalar", "vector", "out"}
    assert float(values["scalar"]) == 4 + 9 + 16
    np.testing.assert_allclose(values["vector"], [20.0, 30.0, 40.0])
    assert float(values["out"]) == 9.0
    assert hook.final_ops_values is values or hook.final_ops_values == values


def test_final_ops_with_zero_steps_warn_and_stay_none(caplog):
    hook = jm.FinalOpsHook({"scalar": sum_of_squares})
    with caplog.at_level(logging.WARNING, logger="jaxmon"):
        with jm.MonitoredSession(vector_step, arange3, hooks=[hook, jm.StopAtStepHook(last_step=0)]) as sess:
            run_loop(sess)
    assert sess.step == 0 and hook.final_values is None
    assert any("FinalOpsHook" in r.getMessage() and r.levelno == logging.WARNING for r in caplog.records)


def test_final_ops_are_not_computed_on_an_error_exit():
    hook = jm.FinalOpsHook({"scalar": sum_of_squares})
    with pytest.raises(ZeroDivisionError):
        with jm.MonitoredSession(vector_step, arange3, hooks=[hook]) as sess:
            sess.run()
            raise ZeroDivisionError("body failed")
    assert sess.step == 1 and hook.final_values is None


@pytest.mark.parametrize("final_fetches", [None, {}, []], ids=["none", "empty-dict", "empty-list"])
def test_final_ops_need_some_fetches(final_fetches):
    with pytest.raises(ValueError, match="final_fetches"):
        jm.FinalOpsHook(final_fetches)
