"""`perf/*` summaries, one of `MonitoredTrainingSession`'s services: the peak table, XLA's
count of a step, and the summaries of a session read back from metrics.jsonl."""

import itertools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxmon as jm
from jaxmon._ops.throughput import peak_tflops, step_flops


def test_the_peak_of_a_device_is_found_by_its_kind():
    assert peak_tflops("NVIDIA H100 80GB HBM3") == 989.0 and peak_tflops("TPU v5 lite") == 197.0
    assert peak_tflops("cpu") is None


def test_step_flops_is_xlas_count_of_one_step():
    def step(state, batch):
        return state @ batch["x"], {}

    assert step_flops(step, jnp.ones((8, 4)), {"x": np.ones((4, 2), np.float32)}) == 2 * 8 * 4 * 2
    abstract = jax.ShapeDtypeStruct((8, 4), jnp.float32)  # the session counts on the state's shapes
    assert step_flops(step, abstract, {"x": jax.ShapeDtypeStruct((4, 2), jnp.float32)}) == 2 * 8 * 4 * 2


def step_fn(state, batch):
    new = state - 0.1 * (batch["x"].T @ (batch["x"] @ state - batch["y"])) / batch["x"].shape[0]
    return new, {"loss": jnp.mean((batch["x"] @ state - batch["y"]) ** 2)}


def test_a_training_session_writes_steps_examples_and_tflops_per_second_at_its_summary_cadence(tmp_path):
    batch = {"x": np.ones((32, 16), np.float32), "y": np.ones((32, 1), np.float32)}
    with jm.MonitoredTrainingSession(step_fn, state=jnp.zeros((16, 1)), data=itertools.repeat(batch),
                                     checkpoint_dir=tmp_path, save_summaries_steps=10,
                                     hooks=[jm.StopAtStepHook(last_step=30)]) as sess:
        while not sess.should_stop():
            sess.run()
    with open(tmp_path / "metrics.jsonl") as lines:
        rows = [row for row in map(json.loads, lines) if "perf/steps_per_sec" in row]
    assert [row["step"] for row in rows] == [10, 20, 30]
    flops = jax.jit(step_fn).lower(jnp.zeros((16, 1)), batch).cost_analysis()["flops"]
    for row in rows:
        rate = row["perf/steps_per_sec"]
        assert rate > 0 and row["perf/examples_per_sec"] == pytest.approx(32 * rate)  # the batch's rows
        assert row["perf/tflops_per_sec_per_device"] == pytest.approx(flops * rate / 1e12)
        assert "perf/mfu" not in row and "perf/tokens_per_sec" not in row  # no peak for a CPU; no tokens known
