"""`perf/*` summaries, one of `MonitoredTrainingSession`'s services: the peak table, the
figures a caller gives, each figure that cannot be computed said once, and the summaries
of sessions read back from metrics.jsonl: a step that accumulates gradients in a
`lax.scan` against the same step unrolled."""

import itertools
import json
import logging
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxmon as jm
from jaxmon._ops.flops import StepFlops, step_flops
from jaxmon.hooks import _throughput
from jaxmon.hooks._throughput import Throughput, peak_tflops


def test_the_peak_of_a_device_is_found_by_its_kind():
    assert peak_tflops("NVIDIA H100 80GB HBM3") == 989.0 and peak_tflops("TPU v5 lite") == 197.0
    assert peak_tflops("cpu") is None


def step_fn(state, batch):
    new = state - 0.1 * (batch["x"].T @ (batch["x"] @ state - batch["y"])) / batch["x"].shape[0]
    return new, {"loss": jnp.mean((batch["x"] @ state - batch["y"]) ** 2)}


def perf_rows(directory):
    with open(directory / "metrics.jsonl") as lines:
        return [row for row in map(json.loads, lines) if "perf/steps_per_sec" in row]


def train(step, state, batch, directory, steps=30, **figures):
    with jm.MonitoredTrainingSession(step, state=state, data=itertools.repeat(batch), checkpoint_dir=directory,
                                     save_summaries_steps=10, hooks=[jm.StopAtStepHook(last_step=steps)],
                                     **figures) as sess:
        while not sess.should_stop():
            sess.run()
    return perf_rows(directory)


def test_a_training_session_writes_steps_examples_and_tflops_per_second_at_its_summary_cadence(tmp_path):
    batch = {"x": np.ones((32, 16), np.float32), "y": np.ones((32, 1), np.float32)}
    rows = train(step_fn, jnp.zeros((16, 1)), batch, tmp_path)
    assert [row["step"] for row in rows] == [10, 20, 30]
    flops = step_flops(step_fn, jnp.zeros((16, 1)), batch).flops
    for row in rows:
        rate = row["perf/steps_per_sec"]
        assert rate > 0 and row["perf/examples_per_sec"] == pytest.approx(32 * rate)  # the batch's rows
        assert row["perf/tflops_per_sec_per_device"] == pytest.approx(flops * rate / 1e12)
        assert "perf/tokens_per_sec" not in row  # no tokens known
        assert ("perf/mfu" in row) == (peak_tflops(jax.devices()[0].device_kind) is not None)  # none for a CPU


def loss(params, x):
    return jnp.mean((jnp.tanh(x @ params["a"]) @ params["b"]) ** 2)


def accumulated(params, batch):
    """One update from the mean gradient of 4 micro-batches of 8 rows, in a `lax.scan`."""
    def add(grads, x):
        return jax.tree.map(jnp.add, grads, jax.grad(loss)(params, x)), None

    grads, _ = jax.lax.scan(add, jax.tree.map(jnp.zeros_like, params), batch["x"])
    return jax.tree.map(lambda p, g: p - 0.01 * g / 4, params, grads), {}


def unrolled(params, batch):
    grads = jax.tree.map(jnp.zeros_like, params)
    for i in range(4):
        grads = jax.tree.map(jnp.add, grads, jax.grad(loss)(params, batch["x"][i]))
    return jax.tree.map(lambda p, g: p - 0.01 * g / 4, params, grads), {}


PARAMS = {"a": jnp.full((64, 128), 0.01), "b": jnp.full((128, 16), 0.01)}
MICRO_BATCHES = {"x": np.ones((4, 8, 64), np.float32)}


def test_a_step_accumulating_micro_batches_in_a_scan_writes_the_tflops_of_the_step_unrolled(tmp_path):
    rows = train(accumulated, PARAMS, MICRO_BATCHES, tmp_path, examples_per_step=32, tokens_per_step=32 * 64,
                 peak_tflops=0.5)
    full = step_flops(unrolled, PARAMS, MICRO_BATCHES).flops
    if jax.default_backend() == "cpu":
        assert full == jax.jit(unrolled).lower(PARAMS, MICRO_BATCHES).cost_analysis()["flops"]  # XLA's own
    assert [row["step"] for row in rows] == [10, 20, 30]
    for row in rows:
        rate = row["perf/steps_per_sec"]
        assert row["perf/tflops_per_sec_per_device"] == pytest.approx(full * rate / 1e12, rel=0.05)
        assert row["perf/mfu"] == pytest.approx(row["perf/tflops_per_sec_per_device"] / 0.5)
        assert row["perf/examples_per_sec"] == pytest.approx(32 * rate)  # the caller's rows, not the 4 micro-batches
        assert row["perf/tokens_per_sec"] == pytest.approx(32 * 64 * rate)


def test_a_step_without_examples_per_step_counts_the_leading_axis_of_its_batch(tmp_path):
    for row in train(accumulated, PARAMS, MICRO_BATCHES, tmp_path, steps=20):
        assert row["perf/examples_per_sec"] == pytest.approx(4 * row["perf/steps_per_sec"])  # the documented rule


def test_flops_per_step_given_are_written_without_counting_the_step(tmp_path, monkeypatch):
    monkeypatch.setattr(_throughput, "step_flops", lambda *args: pytest.fail("the step was counted"))
    batch = {"x": np.ones((32, 16), np.float32), "y": np.ones((32, 1), np.float32)}
    for row in train(step_fn, jnp.zeros((16, 1)), batch, tmp_path, steps=20, flops_per_step=3e9):
        assert row["perf/tflops_per_sec_per_device"] == pytest.approx(3e9 * row["perf/steps_per_sec"] / 1e12)


def perf_notes(caplog):
    return [(r.levelname, r.getMessage()) for r in caplog.records if r.name == "jaxmon" and "perf:" in r.getMessage()]


def test_each_figure_that_cannot_be_computed_is_said_once_with_why_and_the_fix(tmp_path, caplog):
    def step(state, batch):  # a loop whose trip count only the run knows; a batch of one number
        def body(carry):
            return carry[0] + 1, carry[1] @ state
        return jax.lax.while_loop(lambda c: c[0] < batch, body, (0, state))[1] * 0.5, {}

    with caplog.at_level(logging.INFO, logger="jaxmon"):
        rows = train(step, jnp.eye(8), np.int32(3), tmp_path)
    kind, platform = jax.devices()[0].device_kind, jax.default_backend()
    assert len(rows) == 3 and all("perf/tflops_per_sec_per_device" in row for row in rows)
    assert all("perf/examples_per_sec" not in row for row in rows)
    assert all(("perf/mfu" in row) == (peak_tflops(kind) is not None) for row in rows)
    said = [("INFO", "perf: no examples per second: the step's arrays share no leading axis (int32[]); give "
                     "examples_per_step= to MonitoredTrainingSession (perf.examples_per_step in a jaxmon config).")]
    if peak_tflops(kind) is None:  # a CPU
        said.append(("INFO", "perf: no MFU: jaxmon's table of peaks (H100, H200, A100, TPU v4, TPU v5 lite, TPU v5e, "
                             f"TPU v5p, TPU v6 lite, TPU v6e) has none for the device kind {kind!r}; give peak_tflops= "
                             "to MonitoredTrainingSession (perf.peak_tflops in a jaxmon config)."))
    if platform != "cpu":  # a GPU's XLA gives no count before compiling
        said.append(("INFO", f"perf: XLA gives no FLOP count on {platform} before compiling; the step's FLOPs are its "
                             "count of the step lowered for the CPU."))
    said.append(("WARNING", "perf: 1 loop(s) of the step are counted once, not by their trip count (a while_loop's is "
                            "known only as it runs; a scan whose body does not lower alone, as in a shard_map, keeps "
                            "XLA's count): TFLOP/s and MFU are low; for the true figures give flops_per_step= to "
                            "MonitoredTrainingSession (perf.flops_per_step in a jaxmon config)."))
    assert perf_notes(caplog) == said


@pytest.mark.parametrize("failure", ["no count", "an error"])
def test_a_step_whose_flops_cannot_be_counted_writes_the_rest_and_says_why_once(tmp_path, caplog, monkeypatch,
                                                                              failure):
    def count(*args):
        if failure == "an error":
            raise RuntimeError("lowering failed\n  at a line")
        return StepFlops(None, "gpu", why="XLA gives no count of it on gpu nor lowered for the CPU")

    monkeypatch.setattr(_throughput, "step_flops", count)
    batch = {"x": np.ones((32, 16), np.float32), "y": np.ones((32, 1), np.float32)}
    with caplog.at_level(logging.INFO, logger="jaxmon"):
        rows = train(step_fn, jnp.zeros((16, 1)), batch, tmp_path, peak_tflops=1.0)
    assert [sorted(tag for tag in row if tag.startswith("perf/")) for row in rows] == [
        ["perf/examples_per_sec", "perf/steps_per_sec"]] * 3
    why = ("XLA gives no count of it on gpu nor lowered for the CPU" if failure == "no count" else
           "counting the step's FLOPs failed (RuntimeError: lowering failed at a line)")
    assert perf_notes(caplog) == [("WARNING", f"perf: no TFLOP/s or MFU: {why}; give flops_per_step= to "
                                              "MonitoredTrainingSession (perf.flops_per_step in a jaxmon config).")]


def test_an_accelerator_missing_from_the_peak_table_is_warned_of(monkeypatch, caplog):
    device = SimpleNamespace(platform="gpu", device_kind="NVIDIA L4")
    monkeypatch.setattr(jax, "devices", lambda *args: [device])
    with caplog.at_level(logging.INFO, logger="jaxmon"):
        assert _throughput._device_peak() is None
    [(level, message)] = perf_notes(caplog)
    assert level == "WARNING" and "'NVIDIA L4'" in message and "give peak_tflops=" in message


@pytest.mark.parametrize(("figure", "value", "error", "words"), [
    ("peak_tflops", 0, ValueError, "peak_tflops must be a finite number > 0 (the dense peak TFLOP/s of one device) "
                                   "or None; got 0."),
    ("flops_per_step", "1e9", TypeError, "flops_per_step must be a number > 0 (the FLOPs of one step, all devices "
                                         "together) or None; got '1e9' of type str."),
    ("examples_per_step", float("nan"), ValueError, "examples_per_step must be a finite number > 0"),
    ("tokens_per_step", True, TypeError, "tokens_per_step must be a number > 0"),
])
def test_a_figure_that_is_no_positive_number_is_refused_with_its_value(tmp_path, figure, value, error, words):
    with pytest.raises(error, match=f"^MonitoredTrainingSession {words}".replace("(", r"\(").replace(")", r"\)")):
        jm.MonitoredTrainingSession(step_fn, state=jnp.zeros((16, 1)), checkpoint_dir=tmp_path, **{figure: value})
    with pytest.raises(error, match=f"^Throughput {figure}"):
        Throughput(step_fn, **{figure: value})
