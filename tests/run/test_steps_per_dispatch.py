"""steps_per_dispatch: several steps per run in one scan, runs aligned on every trigger.

TF's `steps_per_run` fired triggers late, at the first run end past them (saves at 5, 15,
25 for save_steps=10 with 5 steps per run, summaries likewise). jaxmon cuts its runs
(power-of-two lengths) so that every step-based trigger fires on its exact step, the step
it would fire on with one step per run.
"""

from __future__ import annotations

import json
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import RecordingHook, RecordingWriter, float_zero, programs_for, window_means
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import jaxmon as jm
from jaxmon._checkpoints.manager import complete_steps

# -- shared pieces ---------------------------------------------------------------------------


class RunLengths(jm.Hook):
    """Records every run as the hooks see it: (step before, steps, step after, outputs)."""

    def __init__(self):
        self.runs = []
        self.compiled = None  # the session's compile_count at its end

    def after_run(self, ctx, values):
        self.runs.append((ctx.step, ctx.steps, values.step, dict(values.outputs)))

    def end(self, session):
        self.compiled = session.compile_count

    @property
    def lengths(self):
        return [steps for _, steps, _, _ in self.runs]

    @property
    def ends(self):
        return [end for _, _, end, _ in self.runs]


def is_power_of_two(n):
    return n >= 1 and n & (n - 1) == 0


def add_step(state, batch):
    """A float counter plus the batch's `x`: the output is the new state."""
    state = state + batch["x"]
    return state, {"value": state, "loss": state}


def ones(n):
    """`n` batches each adding 1, so that after step s the counter reads s."""
    return [{"x": np.float32(1.0)} for _ in range(n)]


def train(hooks, last_step, k, data=None, step_fn=add_step, init_fn=float_zero, **kwargs):
    """Runs `add_step` until `last_step` with `k` steps per dispatch; returns (session, run lengths)."""
    lengths = RunLengths()
    data = ones(last_step + 100) if data is None else data
    with jm.MonitoredSession(step_fn, init_fn, data=data, steps_per_dispatch=k,
                             hooks=[*hooks, lengths, jm.StopAtStepHook(last_step=last_step)], **kwargs) as sess:
        while not sess.should_stop():
            sess.run()
    assert all(is_power_of_two(n) and n <= k for n in lengths.lengths), lengths.lengths
    return sess, lengths


def jsonl_steps(path, tag):
    with open(path, encoding="utf-8") as file:
        rows = [json.loads(line) for line in file]
    return [(row["step"], row[tag]) for row in rows if tag in row]


def event_steps(logdir, tag):
    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0})
    acc.Reload()
    return [(event.step, event.value) for event in acc.Scalars(tag)]


# -- a small optax MLP over an ArrayDataSource -----------------------------------------------

ROWS, BATCH, SEED = 64, 8, 3  # 8 batches an epoch, reshuffled each epoch
N = 100
TX = optax.adam(1e-2)


def mlp_arrays():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(ROWS, 4)).astype(np.float32)
    y = (np.sin(x).sum(axis=1, keepdims=True) + 0.1 * rng.normal(size=(ROWS, 1))).astype(np.float32)
    return {"x": x, "y": y}


def mlp_source():
    return jm.ArrayDataSource(mlp_arrays(), batch_size=BATCH, seed=SEED)


def mlp_init():
    k1, k2 = jax.random.split(jax.random.key(0))
    params = {"w1": jax.random.normal(k1, (4, 16)) * 0.5, "b1": jnp.zeros((1, 16)),
              "w2": jax.random.normal(k2, (16, 1)) * 0.5, "b2": jnp.zeros((1, 1))}
    return {"params": params, "opt": TX.init(params), "n": jnp.zeros((), jnp.int32)}


def mlp_loss(params, batch):
    hidden = jnp.tanh(batch["x"] @ params["w1"] + params["b1"])
    return jnp.mean((hidden @ params["w2"] + params["b2"] - batch["y"]) ** 2)


def mlp_step(state, batch):
    loss, grads = jax.value_and_grad(mlp_loss)(state["params"], batch)
    updates, opt = TX.update(grads, state["opt"], state["params"])
    params = optax.apply_updates(state["params"], updates)
    return {"params": params, "opt": opt, "n": state["n"] + 1}, {"loss": loss}


def host(tree):
    return jax.tree.map(np.asarray, tree)


def assert_bit_identical(a, b):
    leaves_a, tree_a = jax.tree.flatten(host(a))
    leaves_b, tree_b = jax.tree.flatten(host(b))
    assert tree_a == tree_b
    for x, y in zip(leaves_a, leaves_b, strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape
        assert np.array_equal(x, y), np.max(np.abs(x.astype(np.float64) - y.astype(np.float64)))


def run_mlp(k, last_step=N, hooks=(), data=None):
    lengths = RunLengths()
    data = mlp_source() if data is None else data
    with jm.MonitoredSession(mlp_step, mlp_init, data=data, steps_per_dispatch=k,
                             hooks=[*hooks, lengths, jm.StopAtStepHook(last_step=last_step)]) as sess:
        while not sess.should_stop():
            sess.run()
    return sess, lengths


@pytest.fixture(scope="module")
def reference_run():
    """N steps of the MLP, one step per run: what every multi-step run must equal."""
    sess, lengths = run_mlp(1)
    assert sess.step == N and lengths.lengths == [1] * N
    return host(sess.state)


# -- 1: the same training, far fewer runs --------------------------------------------------------


def test_k32_gives_the_state_of_k1_bit_for_bit_in_far_fewer_runs(reference_run):
    sess, lengths = run_mlp(32)
    assert sess.step == N
    assert lengths.lengths == [32, 32, 32, 4]  # 100 = 3 * 32 + 4: the last run is cut to end at 100
    assert int(sess.state["n"]) == N
    assert_bit_identical(sess.state, reference_run)
    assert lengths.compiled == programs_for(lengths.lengths)  # one fetch set ("auto": one program on CPU)
    loss = float(mlp_loss(sess.state["params"], {k: jnp.asarray(v) for k, v in mlp_arrays().items()}))
    first = float(mlp_loss(mlp_init()["params"], {k: jnp.asarray(v) for k, v in mlp_arrays().items()}))
    assert loss < first  # it trained


# -- 2: every trigger on its exact step, where TF with several steps per run fired late -------


def test_summaries_every_8_steps_land_on_1_8_16_24_with_that_steps_values(tmp_path):
    hook = jm.SummarySaverHook(save_steps=8, output_dir=tmp_path, reduce="last")  # the write step's value
    sess, lengths = train([hook], last_step=30, k=32)
    assert sess.step == 30
    expected = [(1, 1.0), (8, 8.0), (16, 16.0), (24, 24.0)]  # the loss output reads the step number
    assert jsonl_steps(tmp_path / "metrics.jsonl", "loss") == expected
    assert event_steps(tmp_path, "loss") == expected
    assert lengths.lengths == [1, 4, 2, 1, 8, 8, 4, 2]  # runs end on 1, then 5, 7, 8, 16, 24, then 28, 30
    assert lengths.ends == [1, 5, 7, 8, 16, 24, 28, 30]


def test_summaries_every_8_steps_write_the_mean_of_every_scanned_step_as_with_one_step_per_run(tmp_path):
    written = {}
    for k in (1, 32):
        logdir = tmp_path / f"k{k}"
        sess, lengths = train([jm.SummarySaverHook(save_steps=8, output_dir=logdir)], last_step=30, k=k)  # mean
        assert sess.step == 30
        written[k] = event_steps(logdir, "loss")
        assert jsonl_steps(logdir / "metrics.jsonl", "loss") == written[k]
    assert lengths.lengths == [1, 4, 2, 1, 8, 8, 4, 2]  # k=32: steps 2-8 in 4 + 2 + 1, 9-16 and 17-24 in 8
    # the loss of step t is t: 1, then (1 + 8) / 2 (the write at step 1, the starting point, ends no
    # window), (9 + 16) / 2, (17 + 24) / 2
    means = window_means({t: float(t) for t in range(1, 31)}, [1, 8, 16, 24])
    assert means == [1.0, 4.5, 12.5, 20.5]
    assert written[1] == list(zip([1, 8, 16, 24], means, strict=True))
    assert written[32] == written[1]  # every scanned step is accumulated, not only the run's last


@pytest.mark.parametrize("k, runs", [(5, [4, 4, 2, 4, 4, 2, 4, 4, 2, 4, 1]), (32, [8, 2, 8, 2, 8, 2, 4, 1])])
def test_checkpoints_every_10_steps_land_on_0_10_20_30(k, runs, tmp_path):
    directory = tmp_path / "ckpt"
    hook = jm.CheckpointSaverHook(directory, save_steps=10, max_to_keep=None)
    sess, lengths = train([hook], last_step=35, k=k)
    assert sess.step == 35
    # TF with 5 steps per run saved at 5, 15, 25; here runs end on each multiple of 10
    assert hook.saved_steps == [0, 10, 20, 30, 35]  # 35: the end saves the last, unsaved step
    assert complete_steps(directory) == [0, 10, 20, 30, 35]
    for step in (0, 10, 20, 30, 35):
        restored = jm.restore_checkpoint(os.fspath(directory), step=step, like=float_zero())
        assert restored.step == step and float(restored.state) == step
    assert lengths.lengths == runs


def test_step_counter_every_10_steps_writes_at_10_20_30_40(tmp_path):
    sess, lengths = train([jm.StepCounterHook(every_n_steps=10, output_dir=tmp_path)], last_step=45, k=32)
    assert sess.step == 45
    rates = jsonl_steps(tmp_path / "metrics.jsonl", "global_step/sec")
    # the first run (step 1, which compiles) starts the clock: the first rate covers steps 2-10, as with one
    # step per run
    assert [step for step, _ in rates] == [10, 20, 30, 40]
    assert all(rate > 0 and math.isfinite(rate) for _, rate in rates)
    assert [step for step, _ in event_steps(tmp_path, "global_step/sec")] == [10, 20, 30, 40]
    assert {1, 10, 20, 30, 40} <= set(lengths.ends)


def test_eval_every_50_steps_evaluates_at_50_and_100():
    hook = jm.EvalHook(lambda state, batch: {"value": state}, data=[{"x": 0.0}], every_n_steps=50, at_end=False)
    sess, lengths = train([hook], last_step=120, k=32)
    assert sess.step == 120
    assert [(step, metrics["value"]) for step, metrics in hook.history] == [(50, 50.0), (100, 100.0)]
    assert lengths.lengths == [32, 16, 2, 32, 16, 2, 16, 4]


def test_stop_at_step_37_stops_at_exactly_37():
    sess, lengths = train([], last_step=37, k=32)
    assert sess.step == 37 and float(sess.state) == 37.0
    assert lengths.lengths == [32, 4, 1]


def test_periodic_hook_fires_on_the_steps_it_fires_on_with_one_step_per_run():
    fired = {}
    for k in (1, 32):
        seen = fired[k] = []
        sess, lengths = train([jm.PeriodicHook(lambda session, seen=seen: seen.append(session.step),
                                               every_n_steps=7)], last_step=40, k=k)
        assert sess.step == 40
    assert fired[1] == [7, 14, 21, 28, 35]  # after steps 7, 14, ...: not the first run
    assert fired[32] == fired[1]
    assert lengths.lengths == [4, 2, 1] * 5 + [4, 1]  # runs end on 7, 14, ..., 35, then 39, 40


def test_logging_every_4_iterations_logs_at_steps_1_4_8_12_whatever_the_steps_per_dispatch():
    logged = {}
    for k in (1, 8):
        lines = logged[k] = []  # the loss is the step number: reduce="last" logs the step it logged at
        hook = jm.LoggingHook(["loss"], every_n_iter=4, reduce="last",
                              formatter=lambda values, lines=lines: lines.append(float(values["loss"])) or "")
        sess, _ = train([hook], last_step=24, k=k)
        assert sess.step == 24
    assert logged[1] == [1.0, 4.0, 8.0, 12.0, 16.0, 20.0, 24.0]  # counted in steps, not runs
    assert logged[8] == logged[1]


# -- 3: compilations --------------------------------------------------------------------------


@pytest.mark.parametrize("scan_unroll", ["auto", 1])
def test_a_1000_step_run_with_the_usual_hooks_compiles_one_program_per_run_length_at_most(tmp_path, scan_unroll):
    hooks = [
        jm.StepCounterHook(every_n_steps=100, output_dir=tmp_path),
        jm.SummarySaverHook(save_steps=100, output_dir=tmp_path),
        jm.LoggingHook(["loss"], every_n_iter=100),
        jm.NanHook("loss"),
        jm.CheckpointSaverHook(tmp_path / "ckpt", save_steps=1000),
    ]
    sess, lengths = train(hooks, last_step=1000, k=32, data=ones(1000), scan_unroll=scan_unroll)
    assert sess.step == 1000 and float(sess.state) == 1000.0
    # one fetch set: "auto" on CPU compiles one program for every run length; a scan of each length
    # (as on GPU and TPU) one program per length the runs had, each when first needed
    assert lengths.compiled == programs_for(lengths.lengths, scan_unroll)
    assert set(lengths.lengths) == {1, 32, 4, 2}  # on GPU and TPU: four programs, not 16 nor 8
    # 1000 / 32 = 31.25 runs at best; the runs cut for the triggers every 100 steps add about one per 100
    assert math.ceil(1000 / 32) <= len(lengths.runs) <= 1000 / 32 + 1000 / 100 + 2
    assert sum(lengths.lengths) == 1000
    assert [step for step, _ in jsonl_steps(tmp_path / "metrics.jsonl", "loss")] == [1, *range(100, 1001, 100)]
    assert complete_steps(tmp_path / "ckpt") == [0, 1000]


def test_batches_already_on_the_device_are_stacked_inside_the_step_with_the_same_result():
    recorder = RecordingHook("rec")
    data = [jax.device_put(batch) for batch in ones(200)]
    sess, lengths = train([recorder], last_step=37, k=32, data=data)
    assert lengths.lengths == [32, 4, 1] and float(sess.state) == 37.0
    assert lengths.compiled == programs_for(lengths.lengths)  # as with host batches
    assert len(recorder.contexts[0].original_args.feeds) == 32  # hooks see the list
    assert float(sess.fetch({"next": lambda state, batch, outputs: batch["x"] + state})["next"]) == 38.0  # last batch


class EveryFifteen(jm.Hook):
    """Fetches a callable at steps 1, 16, 31, ... and sleeps between: with 8 steps per
    run, its triggers cut the runs into 8, 4, 2 and 1 steps."""

    def __init__(self):
        self.fetched = []

    def next_trigger(self, step):
        return jm.Trigger(step + ((1 - step) % 15 or 15))

    def before_run(self, ctx):
        if (ctx.step + ctx.steps) % 15 == 1:
            return jm.RunArgs(fetches={"double": double_state})

    def after_run(self, ctx, values):
        if values.results is not None:
            self.fetched.append((values.step, float(values.results["double"])))


def double_state(state, batch, outputs):
    return 2 * state


class CompileCounts(jm.Hook):
    """The session's compile_count after every run (reading it waits for compilations ahead)."""

    def __init__(self):
        self.counts = []

    def after_run(self, ctx, values):
        self.counts.append(ctx.session.compile_count)


def test_runs_of_8_4_2_and_1_steps_compile_each_length_once_in_the_background(caplog):
    counts = CompileCounts()
    with caplog.at_level("INFO", logger="jaxmon"):
        sess, lengths = train([EveryFifteen(), counts], last_step=61, k=8, init_fn=None, state=jnp.float32(0),
                              scan_unroll=1)  # a program per run length, as on GPU and TPU
    assert sess.step == 61 and float(sess.state) == 61.0
    assert set(lengths.lengths) == {8, 4, 2, 1}  # 1, then 8 + 4 + 2 + 1 to each trigger
    assert lengths.ends[:6] == [1, 9, 13, 15, 16, 24]
    # the fetch set with the callable runs one step a time (1, 16, ...): its one program; the runs without it,
    # 8, 4, 2 and 1 steps: one each, the new lengths compiled in the background while their first run goes
    # step by step
    assert counts.counts[0] == 2 and counts.counts[-1] == 5 and counts.counts == sorted(counts.counts)
    fetched = next(hook for hook in sess.hooks if isinstance(hook, EveryFifteen)).fetched
    assert fetched == [(1, 2.0), (16, 32.0), (31, 62.0), (46, 92.0), (61, 122.0)]
    logged = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Compiled the step")]
    assert logged[0].startswith("Compiled the step for runs of 1 step with 1 fetched value in ")
    assert any(line.startswith("Compiled the step ahead for runs of ") for line in logged), logged


def test_batches_of_one_run_that_cannot_be_stacked_say_so():
    data = [{"x": jnp.ones((2,))}] * 3 + [{"x": jnp.ones((3,))}] * 5
    with pytest.raises(ValueError, match="batches of one run must have the same structure and shapes"):
        train([], last_step=8, k=4, data=data, init_fn=lambda: jnp.zeros((2,)))
    with pytest.raises(ValueError, match="batches of one run must have the same structure and shapes"):
        train([], last_step=8, k=4, data=[{"x": np.ones(2, np.float32)}] * 3 + [{"x": np.ones(3, np.float32)}] * 5,
              init_fn=lambda: jnp.zeros((2,)))


# -- 4: hooks see runs -------------------------------------------------------------------------


def test_hooks_see_each_run_with_its_length_and_the_last_steps_outputs():
    recorder = RecordingHook("rec")
    sess, lengths = train([recorder], last_step=37, k=32)
    assert [ctx.steps for ctx in recorder.contexts] == [32, 4, 1] == lengths.lengths
    assert [ctx.step for ctx in recorder.contexts] == [0, 32, 36]
    for ctx, values in zip(recorder.contexts, recorder.values, strict=True):
        assert ctx.next_step == ctx.step + ctx.steps
        assert values.step == ctx.next_step
        assert float(values.outputs["value"]) == values.step  # the last step's output, not the first
    batches = recorder.contexts[0].original_args.feeds  # the run's batches, as a list
    assert len(batches) == 32 and all(float(batch["x"]) == 1.0 for batch in batches)


# -- 5: fetch callables and feeds -------------------------------------------------------------


def fetch_last(state, batch, outputs):
    return {"x": batch["x"], "state": state, "value": outputs["value"], "inc": batch["inc"]}


def add_inc_step(state, batch):
    state = state + batch["inc"]
    return state, {"value": state, "x": batch["x"]}


def test_fetch_callables_see_the_last_step_and_feeds_reach_every_step():
    data = [{"x": np.float32(i)} for i in range(1, 101)]  # step s takes x = s
    fetcher = RecordingHook("fetch", fetches={"last": fetch_last})
    feeder = jm.FeedFnHook(lambda: {"inc": np.float32(2.0)})
    sess, lengths = train([feeder, fetcher], last_step=37, k=32, data=data, step_fn=add_inc_step)
    assert lengths.lengths == [32, 4, 1]
    assert float(sess.state) == 2.0 * 37  # the feed was added on every one of the 37 steps
    got = [(v.step, {key: float(value) for key, value in v.results["last"].items()}) for v in fetcher.values]
    assert got == [
        (32, {"x": 32.0, "state": 64.0, "value": 64.0, "inc": 2.0}),
        (36, {"x": 36.0, "state": 72.0, "value": 72.0, "inc": 2.0}),
        (37, {"x": 37.0, "state": 74.0, "value": 74.0, "inc": 2.0}),
    ]
    # sess.fetch after a multi-step run also sees the last step's batch
    assert float(sess.fetch({"last": fetch_last})["last"]["x"]) == 37.0


# -- 6: data ---------------------------------------------------------------------------------


def test_the_end_of_data_mid_run_runs_what_is_left_in_power_of_two_runs():
    data = [{"x": np.float32(i)} for i in range(1, 46)]  # 45 batches
    lengths = RunLengths()
    with jm.MonitoredSession(add_step, float_zero, data=data, steps_per_dispatch=32, hooks=[lengths]) as sess:
        while not sess.should_stop():
            sess.run()
    assert sess.should_stop()
    assert sess.step == 45
    assert float(sess.state) == sum(range(1, 46))  # every batch once, none twice
    assert lengths.lengths == [32, 8, 4, 1]


def test_a_run_resumed_from_a_multi_step_checkpoint_equals_an_uninterrupted_one(reference_run, tmp_path):
    directory = tmp_path / "ckpt"
    saver = jm.CheckpointSaverHook(directory, save_steps=1000)
    first, lengths = run_mlp(32, last_step=37, hooks=[saver])
    assert first.step == 37 and lengths.lengths == [32, 4, 1]
    assert saver.saved_steps == [0, 37]  # the end saves the last step
    meta = jm.restore_checkpoint(os.fspath(directory), step=37, like=mlp_init()).meta
    assert meta["data"] == {"epoch": 37 // 8, "index": 37 % 8, "seed": SEED}  # 37 batches taken, none ahead

    saver = jm.CheckpointSaverHook(directory, save_steps=1000)
    resumed, lengths = run_mlp(32, last_step=N, hooks=[saver])
    assert resumed.restored_step == 37 and resumed.step == N
    assert lengths.lengths == [32, 16, 8, 4, 2, 1]  # 63 steps
    assert_bit_identical(resumed.state, reference_run)


# -- 7: run() with a list, argument checks ----------------------------------------------------


def test_run_with_a_list_of_batches_runs_that_many_steps():
    recorder = RecordingHook("rec")
    with jm.MonitoredSession(add_step, float_zero, steps_per_dispatch=4, hooks=[recorder]) as sess:
        out = sess.run([{"x": np.float32(i)} for i in (1, 2, 3)], fetches=["value"])
        assert sess.step == 3 and isinstance(out, list) and len(out) == 1 and float(out[0]) == 6.0
        sess.run([{"x": np.float32(10.0)}] * 4)
        assert sess.step == 7 and float(sess.state) == 46.0
    assert [ctx.steps for ctx in recorder.contexts] == [3, 4]


@pytest.mark.parametrize("value", [0, -1, "x", 2.0, True])
def test_a_bad_steps_per_dispatch_raises_value_error_naming_it(value):
    with pytest.raises(ValueError, match="steps_per_dispatch"):
        jm.MonitoredSession(add_step, float_zero, steps_per_dispatch=value)


def test_steps_per_dispatch_with_a_mesh_stacks_one_number_a_step_replicated():
    # 8 devices and several processes: tests/end_to_end/test_dispatch_scaled.py
    mesh = jax.make_mesh((1,), ("data",))
    with jm.MonitoredSession(add_step, float_zero, steps_per_dispatch=2, mesh=mesh) as sess:
        sess.run([{"x": np.float32(1.0)}, {"x": np.float32(2.0)}])
        assert sess.step == 2 and float(sess.state) == 3.0
        sess.run({"x": np.float32(4.0)})
    assert sess.step == 3 and float(sess.state) == 7.0


# -- 8: NaN checks -----------------------------------------------------------------------------


def nan_at_10(state, batch):
    state = state + jnp.where(batch["x"] == 10.0, jnp.nan, 1.0)  # step 10 poisons the state
    return state, {"loss": state}


def test_a_nan_in_the_middle_of_a_run_is_reported_at_its_exact_step():
    data = [{"x": np.float32(i)} for i in range(1, 201)]
    lengths = RunLengths()
    with pytest.raises(jm.NanLossDuringTrainingError) as info:
        with jm.MonitoredSession(nan_at_10, float_zero, data=data, steps_per_dispatch=32,
                                 hooks=[jm.NanHook("loss", every_n_steps=32), lengths,
                                        jm.StopAtStepHook(last_step=200)]) as sess:
            while not sess.should_stop():
                sess.run()
    assert info.value.step == 10  # checked on the device at each scanned step
    assert "at step 10" in str(info.value)
    assert sess.step == 64  # read at the end of the first run (step 32), delivered a run late
    assert lengths.ends[0] == 32


@pytest.mark.parametrize("reduce", ["last", "mean"])
@pytest.mark.parametrize("every, k", [(10, 5), (5, 5), (5, 10)])
def test_settings_tf_wrote_late_write_summaries_where_one_step_per_run_does(every, k, reduce):
    # TF wrote at (every, k) = (10, 5): 15, 25; (5, 5): 10, 15, 20, 25; (5, 10): 20, 30, 40, 50
    written = {}
    for steps in (1, k):
        writer = written[steps] = RecordingWriter()
        hook = jm.SummarySaverHook(save_steps=every, summary_writer=writer, reduce=reduce)
        sess, _ = train([hook], last_step=50, k=steps)
        assert sess.step == 50
    expected = [1, *range(every, 51, every)]  # step 1, then every `every` steps counted from step 0
    assert expected == ([1, 10, 20, 30, 40, 50] if every == 10 else [1, 5, 10, 15, 20, 25, 30, 35, 40, 45, 50])
    assert [step for step, _ in written[1].scalars] == expected
    assert written[k].scalars == written[1].scalars  # the same steps with the same values
    if reduce == "last":  # TF: the loss of the write step, which reads the step number
        assert all(scalars["loss"] == step for step, scalars in written[k].scalars)
    else:  # the mean of the step numbers since the previous write, but the first regular write's from step 1
        # (the write at step 1, the starting point, ends no window): for every=10, 1, (1 + 10) / 2 = 5.5 at 10,
        # (11 + 20) / 2 = 15.5 at 20; for every=5, 1, (1 + 5) / 2 = 3 at 5, (6 + 10) / 2 = 8 at 10
        means = window_means({t: float(t) for t in range(1, 51)}, expected)
        assert means[:3] == ([1.0, 5.5, 15.5] if every == 10 else [1.0, 3.0, 8.0])
        assert [scalars["loss"] for _, scalars in written[k].scalars] == means
