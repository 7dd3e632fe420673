"""Warm start: a fresh state takes the leaves of a checkpoint whose path, shape and dtype
match, a TrainState's bookkeeping stays fresh, and the report names every leaf's fate."""

import logging

import jax.numpy as jnp
import numpy as np
import pytest

from jaxmon._checkpoints.manager import Checkpoints
from jaxmon._checkpoints.warm_start import WarmStartReport, warm_start


def checkpoint(directory, state, step=10):
    """`state` saved as checkpoint `step` of `directory`; returns the directory."""
    checkpoints = Checkpoints(directory, writer=True, async_save=False)
    try:
        checkpoints.save(step, state, {"step": step})
    finally:
        checkpoints.close()
    return directory


def test_matching_leaves_are_taken_and_the_report_names_the_rest(tmp_path, caplog):
    source = checkpoint(tmp_path / "pretrained", {"trunk": {"w": jnp.full((2, 3), 7.0), "b": jnp.ones(3)},
                                                  "head": jnp.ones((3, 5)), "extra": jnp.zeros(1)})
    fresh = {"trunk": {"w": jnp.zeros((2, 3)), "b": jnp.zeros(3, jnp.int32)}, "head": jnp.zeros((3, 2)),
             "new": jnp.zeros(4)}
    with caplog.at_level(logging.INFO, logger="jaxmon"):
        state, report = warm_start(fresh, source)
    np.testing.assert_array_equal(state["trunk"]["w"], np.full((2, 3), 7.0))
    for kept in (state["trunk"]["b"], state["head"], state["new"]):  # dtype, shape or absence: left fresh
        assert not np.any(np.asarray(kept))
    assert state["trunk"]["b"].dtype == jnp.int32
    assert report == WarmStartReport(
        source=str(source), restored=["trunk/w"], fresh=["new"],
        mismatched=["head (checkpoint float32[3, 5], state float32[3, 2])",  # in the state's leaf order
                    "trunk/b (checkpoint float32[3], state int32[3])"],
        unused=["extra"], skipped=())
    assert any(r.getMessage().startswith(f"Warm start from {source}: restored 1 leaves") for r in caplog.records)


def test_a_train_states_optimizer_state_step_and_rng_stay_fresh(tmp_path):
    trained = {"params": {"w": jnp.full(3, 2.0)}, "opt_state": {"mu": jnp.full(3, 9.0)}, "step": jnp.int32(500),
               "rng": jnp.arange(2, dtype=jnp.uint32)}
    source = checkpoint(tmp_path, trained)
    fresh = {"params": {"w": jnp.zeros(3)}, "opt_state": {"mu": jnp.zeros(3)}, "step": jnp.int32(0),
             "rng": jnp.zeros(2, jnp.uint32)}
    state, report = warm_start(fresh, source)
    np.testing.assert_array_equal(state["params"]["w"], np.full(3, 2.0))
    assert int(state["step"]) == 0 and not np.any(np.asarray(state["opt_state"]["mu"]))
    assert report.restored == ["params/w"] and report.skipped == ("opt_state/mu", "rng", "step")
    assert report.unused == [] and report.fresh == []


def test_a_state_without_params_takes_every_matching_part(tmp_path):
    source = checkpoint(tmp_path, {"step": jnp.int32(7), "w": jnp.ones(2)})
    state, report = warm_start({"step": jnp.int32(0), "w": jnp.zeros(2)}, source)
    assert int(state["step"]) == 7 and report.restored == ["step", "w"] and report.skipped == ()


def test_a_function_warm_starts_the_state_itself_without_a_report():
    state, report = warm_start(jnp.zeros(2), lambda state: state + 1)
    np.testing.assert_array_equal(state, np.ones(2))
    assert report is None


def test_a_source_without_a_checkpoint_is_an_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="No checkpoint in"):
        warm_start({"w": jnp.zeros(2)}, tmp_path)
