"""steps_per_dispatch with a mesh and with several JAX processes: the runs of several
steps give the state of one step per run, and every hook's step trigger its exact step.

Two launches of this file as a script, each bounded by a timeout:

* `python tests/end_to_end/test_dispatch_scaled.py mesh ROOT` with 8 simulated CPU
  devices trains on a data-parallel mesh (8,) and on a ("data", "fsdp") mesh (4, 2) with a sharded
  state, one step per run and 4, with the same hooks; it writes `ROOT/results.json`,
  the final states as `.npz`, and each session's summaries and checkpoints;
* `python tests/end_to_end/test_dispatch_scaled.py worker PID ADDRESS ROOT`, twice:
  two JAX processes on 127.0.0.1 with 4 CPU devices each, one mesh over all 8, each process
  reading its own shard of the rows, train with 1 and 4 steps per run, then 4 stopped
  at step 12 and resumed from its checkpoint, then 4 with SIGTERM sent to process 1;
  each prints one `RESULT {json}` line per session.

The tests read those results and artefacts back.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import warm_processes
from helpers import cpu_env, free_port, with_helpers_path
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import jaxmon as jm
from jaxmon._checkpoints.manager import complete_steps

LAST_STEP = 23
TX = optax.adam(1e-2)

# -- the model and the data, shared by every launch ---------------------------------------------


def init_fn():
    k1, k2 = jax.random.split(jax.random.PRNGKey(0))
    params = {"w1": jax.random.normal(k1, (4, 16)) * 0.5, "b1": jnp.zeros((1, 16)),
              "w2": jax.random.normal(k2, (16, 1)) * 0.5, "b2": jnp.zeros((1, 1))}
    return {"params": params, "opt": TX.init(params)}


def loss_fn(params, batch):
    hidden = jnp.tanh(batch["x"] @ params["w1"] + params["b1"])
    return jnp.mean((hidden @ params["w2"] + params["b2"] - batch["y"]) ** 2)  # a mean over the split batch


def step_fn(state, batch):
    loss, grads = jax.value_and_grad(loss_fn)(state["params"], batch)
    updates, opt = TX.update(grads, state["opt"], state["params"])
    return {"params": optax.apply_updates(state["params"], updates), "opt": opt}, {"loss": loss}


def make_data(batch_size=32, shard=None):
    """96 rows reshuffled each epoch; `shard="process"`: this process's 48 of them."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(96, 4)).astype(np.float32)
    return jm.ArrayDataSource({"x": x, "y": np.sin(x.sum(1, keepdims=True))}, batch_size=batch_size, seed=3,
                              shard=shard)


def fsdp_columns(abstract_state):
    """A state_sharding function: every leaf with 16 columns (w1, b1 and Adam's mu and nu of
    both) split by column over "fsdp", the rest replicated."""
    return jax.tree.map(lambda leaf: P(None, "fsdp") if leaf.shape[-1:] == (16,) else P(), abstract_state)


def flat(state):
    """{"params/w1": host array, ...}: every leaf of a replicated or sharded state."""
    return {jax.tree_util.keystr(path, simple=True, separator="/"): np.asarray(jax.device_get(leaf))
            for path, leaf in jax.tree_util.tree_leaves_with_path(state)}


def host_flat(state):
    """`flat` with several processes: each leaf as this process sees it (replicated leaves)."""
    return {key: np.asarray(leaf.addressable_data(0))
            for key, leaf in zip(flat_keys(state), jax.tree.leaves(state), strict=True)}


def flat_keys(state):
    return [jax.tree_util.keystr(path, simple=True, separator="/")
            for path, _ in jax.tree_util.tree_leaves_with_path(state)]


def hooks(directory, *, summaries, log_every, checkpoint_every, chief=True):
    """Summaries (chief only) to metrics.jsonl, a log line and a checkpoint on triggers that 4
    does not divide, a stop at LAST_STEP; returns (hooks, the steps logged)."""
    logged = []
    found = [jm.LoggingHook(["loss"], every_n_iter=log_every,
                            formatter=lambda values, step: logged.append(step) or f"step {step}"),
             jm.CheckpointSaverHook(os.path.join(directory, "ckpt"), save_steps=checkpoint_every, max_to_keep=None),
             jm.StopAtStepHook(last_step=LAST_STEP)]
    if chief:
        found.insert(0, jm.SummarySaverHook(save_steps=summaries, output_dir=directory))
    return found, logged


def loop(sess):
    """Runs `sess` to its stop; returns the steps of each run, as the loop sees them."""
    lengths = []
    with sess:
        while not sess.should_stop():
            before = sess.step
            sess.run()
            lengths.append(sess.step - before)
    return lengths


# -- the 8-device child ---------------------------------------------------------------------------


def mesh_main(root):
    assert jax.device_count() == 8, jax.devices()
    jax.config.update("jax_default_matmul_precision", "float32")
    data8 = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
    fsdp = jax.make_mesh((4, 2), ("data", "fsdp"), axis_types=(AxisType.Auto,) * 2)
    results = {"placement": placement(data8, fsdp)}
    cadences = {"data": dict(summaries=3, log_every=5, checkpoint_every=6),
                "fsdp": dict(summaries=7, log_every=9, checkpoint_every=6)}
    for name, mesh, spec in [("data", data8, None), ("fsdp", fsdp, fsdp_columns)]:
        for k in (1, 4):
            run = f"{name}_k{k}"
            try:
                found, logged = hooks(os.path.join(root, run), **cadences[name])
                # "auto" on CPU: one program takes every run length; 1: one per length, as on GPU and TPU
                sess = jm.MonitoredSession(step_fn, init_fn, data=make_data(), mesh=mesh, state_sharding=spec,
                                           hooks=found, steps_per_dispatch=k,
                                           scan_unroll="auto" if name == "data" else 1)
                lengths = loop(sess)
                np.savez(os.path.join(root, f"{run}.npz"), **flat(sess.state))
                w1 = sess.state["params"]["w1"].sharding
                results[run] = {"step": sess.step, "lengths": lengths, "logged": logged,
                                "compile_count": sess.compile_count, "w1_spec": [str(e) for e in w1.spec],
                                "w1_shard": list(w1.shard_shape((4, 16)))}
            except Exception as error:  # noqa: BLE001 - recorded, so that one failure fails its own tests only
                results[run] = {"error": f"{type(error).__name__}: {error}"}
    with open(os.path.join(root, "results.json"), "w", encoding="utf-8") as file:
        json.dump(results, file)


def placement(data8, fsdp):
    """How `place_batch` shards a stacked batch of 4 steps: (spec, shard shape) per leaf."""
    from jaxmon._run.sharding import Placement

    stacked = {"x": np.zeros((4, 32, 4), np.float32), "w": np.zeros((4,), np.float32)}
    out = {}
    for name, mesh, spec in [("default", data8, None), ("fsdp", fsdp, None), ("given", fsdp, {"x": P("data"),
                                                                                              "w": P()})]:
        placed = Placement(mesh, batch_sharding=spec).place_batch(stacked, 4)
        out[name] = {key: [[str(e) for e in leaf.sharding.spec], list(leaf.sharding.shard_shape(leaf.shape))]
                     for key, leaf in placed.items()}
    return out


# -- the workers of two processes -------------------------------------------------------------------


def worker_main(pid, address, root):
    jm.distributed.initialize(address, num_processes=2, process_id=pid, initialization_timeout=60)
    jax.config.update("jax_default_matmul_precision", "float32")
    assert jax.process_count() == 2 and jax.device_count() == 8 and jax.local_device_count() == 4
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
    for run, k, last_step, directory in [("k1", 1, LAST_STEP, "k1"), ("k4", 4, LAST_STEP, "k4"),
                                         ("k4_half", 4, 12, "resumed"), ("k4_resumed", 4, LAST_STEP, "resumed")]:
        result = {"run": run, "process": pid}
        try:
            found, logged = hooks(os.path.join(root, directory), summaries=7, log_every=9, checkpoint_every=6,
                                  chief=pid == 0)
            found[-1] = jm.StopAtStepHook(last_step=last_step)
            sess = jm.MonitoredSession(step_fn, init_fn, data=make_data(16, shard="process"), mesh=mesh,
                                       hooks=found, steps_per_dispatch=k)
            restored = sess.restored_step
            lengths = loop(sess)
            np.savez(os.path.join(root, f"{run}_p{pid}.npz"), **host_flat(sess.state))
            result.update(step=sess.step, restored=restored, lengths=lengths, logged=logged,
                          agreements=sess._agreed.rounds, compile_count=sess.compile_count)
        except Exception as error:  # noqa: BLE001 - recorded: one failure fails its own tests only
            result["error"] = f"{type(error).__name__}: {error}"
        print("RESULT " + json.dumps(result), flush=True)
    preempted(pid, mesh, root)


def preempted(pid, mesh, root):
    """Process 1 gets SIGTERM after its run to step 4 or more. No hook acts and the processes do
    not agree before step 399, so after the first run every run is 4 steps long: JAX's preemption
    sync step, the step after the last one some process had reached, falls inside one."""
    result = {"run": "k4_sigterm", "process": pid}
    try:
        sess = jm.MonitoredSession(step_fn, init_fn, data=make_data(16, shard="process"), mesh=mesh,
                                   steps_per_dispatch=4, agree_every_n_steps=512, hooks=[
                                       jm.CheckpointSaverHook(os.path.join(root, "sigterm"), save_steps=1000),
                                       jm.StopAtStepHook(last_step=400)])
        lengths, signalled = [], None
        with sess:
            while not sess.should_stop():
                before = sess.step
                sess.run()
                lengths.append(sess.step - before)
                if pid == 1 and signalled is None and sess.step >= 4:
                    signalled = sess.step
                    os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(0.05)  # the sync step is agreed while the processes train on
        np.savez(os.path.join(root, f"k4_sigterm_p{pid}.npz"), **host_flat(sess.state))
        result.update(step=sess.step, lengths=lengths, preempted=sess.preemption_requested, signalled=signalled)
    except Exception as error:  # noqa: BLE001 - recorded: one failure fails its own tests only
        result["error"] = f"{type(error).__name__}: {error}"
    print("RESULT " + json.dumps(result), flush=True)


# -- one process: runs between agreement points, with a peer's all-gather row faked -------------------


class OneStepSession:
    """What `AgreedRuns` reads of a session: its step."""

    def __init__(self):
        self.step = 0


class QuietRunner:  # this process's hooks never act; its run limit is its own trigger at 6
    hooks = ()

    def next_event(self):
        return math.inf, math.inf

    def deliver_late(self):
        pass

    @staticmethod
    def run_limit(step, limit):
        return min(limit, 6 - step) if step < 6 else limit


def test_agreed_runs_of_4_steps_never_cross_an_agreement_point(monkeypatch):
    from jaxmon._processes import agree as _agree
    from jaxmon._run.batches import BatchSource, Steps
    from jaxmon._run.stopping import Preemption, Stopping

    agreed_at = []

    def gather(values, step):  # the peer has a hook acting at step 13 (its plan's event), then none
        agreed_at.append(step)
        row = [0.0, 0.0, 0.0, -1.0, 13.0 if step < 13 else math.inf, math.inf, math.inf, 0.0, 0.001]
        return np.stack([values, np.asarray(row, np.float64)])

    monkeypatch.setattr(_agree, "_gather", gather)
    session, runner = OneStepSession(), QuietRunner()
    batches = BatchSource(make_data(4), 4, runner.run_limit)
    stopping = Stopping(Preemption(handle_sigterm=False, several_processes=False), agreed=True)
    agreed = _agree.AgreedRuns(batches, runner, stopping, session, every_n_steps=8)
    lengths = []

    def run_once(batch):
        lengths.append(len(batch.items) if isinstance(batch, Steps) else 1)
        session.step += lengths[-1]

    while session.step < 24:
        agreed.run(run_once, None)
    # agreement points: 0 (before the first run), 8, 12 and 13 (the peer's trigger and the step before), 16, 24;
    # this process's own trigger at 6 cuts its run too
    assert agreed_at == [0, 8, 12, 13, 16, 24]
    assert lengths == [4, 2, 2, 4, 1, 2, 1, 4, 4]
    assert np.cumsum(lengths).tolist() == [4, 6, 8, 12, 13, 15, 16, 20, 24]


# -- the tests: 8 devices, one process ---------------------------------------------------------------


def metrics(directory):
    """{step: loss} of the summaries written to `directory`/metrics.jsonl."""
    rows = [json.loads(line) for line in (Path(directory) / "metrics.jsonl").read_text().splitlines()]
    return {row["step"]: row["loss"] for row in rows if "loss" in row}


def states(root, *names):
    return [dict(np.load(Path(root) / f"{name}.npz")) for name in names]


def assert_same_state(a, b):
    assert sorted(a) == sorted(b)
    for key in a:
        np.testing.assert_array_equal(a[key], b[key], err_msg=key)


@pytest.fixture(scope="module")
def mesh_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("dispatch_mesh")
    process = warm_processes.run([sys.executable, __file__, "mesh", str(root)], capture_output=True, text=True,
                                 env=with_helpers_path(cpu_env(devices=8)), timeout=400)
    assert process.returncode == 0, process.stdout[-3000:] + process.stderr[-5000:]
    results = json.loads((root / "results.json").read_text())
    return root, results


def ok(results, run):
    result = results[run]
    assert "error" not in result, result["error"]
    return result


@pytest.mark.slow
def test_a_stacked_batch_keeps_its_steps_axis_whole_and_shards_each_steps_batch(mesh_run):
    _, results = mesh_run
    placed = results["placement"]
    # (4 steps, 32 rows, 4): each device holds every step's 4 (or 16) rows; one number a step: replicated
    assert placed["default"] == {"x": [["None", "data"], [4, 4, 4]], "w": [["None"], [4]]}
    assert placed["fsdp"] == {"x": [["None", "('data', 'fsdp')"], [4, 4, 4]], "w": [["None"], [4]]}
    # batch_sharding=P("data") is one step's: the steps axis comes before it
    assert placed["given"] == {"x": [["None", "data"], [4, 8, 4]], "w": [["None"], [4]]}


@pytest.mark.slow
@pytest.mark.parametrize("mesh", ["data", "fsdp"])
def test_four_steps_a_run_on_a_mesh_give_the_state_of_one_bit_for_bit(mesh_run, mesh):
    root, results = mesh_run
    one, four = ok(results, f"{mesh}_k1"), ok(results, f"{mesh}_k4")
    assert one["step"] == four["step"] == LAST_STEP
    assert_same_state(*states(root, f"{mesh}_k1", f"{mesh}_k4"))
    assert one["lengths"] == [1] * LAST_STEP
    assert sum(four["lengths"]) == LAST_STEP and max(four["lengths"]) > 1


@pytest.mark.slow
def test_triggers_that_4_does_not_divide_cut_the_runs_of_a_data_parallel_mesh(mesh_run):
    _, results = mesh_run
    four = ok(results, "data_k4")
    # summaries 1, 3, 6, ...; logs 1, 5, 10, ...; checkpoints 6, 12, 18; the stop at 23
    assert four["lengths"] == [1, 2, 2, 1, 2, 1, 1, 2, 2, 1, 2, 1, 2, 1, 2]
    # one program for runs of up to 4 steps ("auto" on CPU), the batch padded to 4 on its shardings
    # (with 4 of 4 runs of one step, 8 of two: 15 dispatches for 23 steps)
    assert four["compile_count"] == 1


@pytest.mark.slow
def test_the_fsdp_mesh_keeps_its_state_sharding_and_runs_4_steps(mesh_run):
    _, results = mesh_run
    four = ok(results, "fsdp_k4")
    assert four["w1_spec"] == ["None", "fsdp"] and four["w1_shard"] == [4, 8]
    # summaries 1, 7, 14, 21; logs 1, 9, 18; checkpoints 6, 12, 18; the stop at 23
    assert four["lengths"] == [1, 4, 1, 1, 2, 2, 1, 2, 4, 2, 1, 2]
    assert four["compile_count"] == 3  # scan_unroll=1: one program a run length, 4 and 2 compiled ahead


@pytest.mark.slow
@pytest.mark.parametrize("mesh", ["data", "fsdp"])
def test_summaries_logs_and_checkpoints_of_a_mesh_land_on_the_steps_of_one_step_a_run(mesh_run, mesh):
    root, results = mesh_run
    one, four = ok(results, f"{mesh}_k1"), ok(results, f"{mesh}_k4")
    written = {k: metrics(root / f"{mesh}_k{k}") for k in (1, 4)}
    every, log_every = (3, 5) if mesh == "data" else (7, 9)
    assert sorted(written[1]) == [1, *range(every, LAST_STEP + 1, every)]
    assert sorted(written[4]) == sorted(written[1])
    assert written[4] == pytest.approx(written[1], rel=1e-6)  # the mean over each window, every step counted
    assert one["logged"] == four["logged"] == [1, *range(log_every, LAST_STEP + 1, log_every)]
    saved = {k: complete_steps(root / f"{mesh}_k{k}" / "ckpt") for k in (1, 4)}
    assert saved[1] == saved[4] == [0, 6, 12, 18, 23]
    restored = jm.restore_checkpoint(root / f"{mesh}_k4" / "ckpt", step=12)
    expected = jm.restore_checkpoint(root / f"{mesh}_k1" / "ckpt", step=12)
    assert restored.step == expected.step == 12
    assert_same_state(flat(restored.state), flat(expected.state))


# -- the tests: two processes ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory):
    root = tmp_path_factory.mktemp("dispatch_processes")
    address = f"127.0.0.1:{free_port()}"
    processes = [warm_processes.popen([sys.executable, __file__, "worker", str(pid), address, str(root)],
                                      env=with_helpers_path(cpu_env(devices=4)),
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                 for pid in range(2)]
    try:
        deadline, outputs = time.monotonic() + 400, []
        for process in processes:
            out, _ = process.communicate(timeout=max(1.0, deadline - time.monotonic()))
            outputs.append(out)
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait(timeout=10)
    assert [process.returncode for process in processes] == [0, 0], "\n---\n".join(o[-4000:] for o in outputs)
    results = [{r["run"]: r for r in (json.loads(line[len("RESULT "):]) for line in out.splitlines()
                                      if line.startswith("RESULT "))} for out in outputs]
    return root, results, outputs


def both(two_processes, run):
    _, results, outputs = two_processes
    found = [results[pid].get(run) for pid in range(2)]
    assert all(found), f"no result for {run!r}:\n" + "\n---\n".join(o[-3000:] for o in outputs)
    for result in found:
        assert "error" not in result, result["error"]
    return found


@pytest.mark.processes
@pytest.mark.slow
def test_two_processes_with_4_steps_a_run_end_with_the_parameters_of_one(two_processes):
    root = two_processes[0]
    one, four = both(two_processes, "k1"), both(two_processes, "k4")
    assert [r["step"] for r in one + four] == [LAST_STEP] * 4
    k1_p0, k1_p1, k4_p0, k4_p1 = states(root, "k1_p0", "k1_p1", "k4_p0", "k4_p1")
    assert_same_state(k1_p0, k1_p1)
    assert_same_state(k4_p0, k4_p1)
    assert_same_state(k1_p0, k4_p0)  # bit for bit: the scan is a loop of the same step (scan_unroll="auto": 1)
    # Both cut their runs at the same steps: at each agreement point, which every hook's trigger is (the chief's
    # summaries at 1, 7, 14, 21 too), and the step before it; runs of 4 where nothing acts.
    assert four[0]["lengths"] == four[1]["lengths"] == [1, 4, 1, 1, 1, 1, 2, 1, 1, 1, 2, 1, 1, 2, 1, 1, 1]
    assert four[0]["compile_count"] == four[1]["compile_count"] == 1  # one program for runs of 4, 2 and 1 steps
    assert one[0]["lengths"] == [1] * LAST_STEP


@pytest.mark.processes
@pytest.mark.slow
def test_two_processes_write_and_save_on_the_steps_of_one_step_a_run(two_processes):
    root = two_processes[0]
    one, four = both(two_processes, "k1"), both(two_processes, "k4")
    assert [r["logged"] for r in one + four] == [[1, 9, 18]] * 4
    written = {k: metrics(root / k) for k in ("k1", "k4")}
    assert sorted(written["k1"]) == sorted(written["k4"]) == [1, 7, 14, 21]  # the chief's only
    assert written["k4"] == pytest.approx(written["k1"], rel=1e-6)
    assert complete_steps(root / "k1" / "ckpt") == complete_steps(root / "k4" / "ckpt") == [0, 6, 12, 18, 23]


@pytest.mark.processes
@pytest.mark.slow
def test_two_processes_with_4_steps_a_run_resume_from_a_checkpoint(two_processes):
    root = two_processes[0]
    half, resumed = both(two_processes, "k4_half"), both(two_processes, "k4_resumed")
    assert [r["step"] for r in half] == [12, 12]
    assert [r["restored"] for r in resumed] == [12, 12] and [r["step"] for r in resumed] == [LAST_STEP] * 2
    assert resumed[0]["lengths"] == resumed[1]["lengths"] == [1, 1, 2, 1, 1, 2, 1, 1, 1]  # as k4's from step 12
    assert [r["logged"] for r in resumed] == [[18]] * 2
    assert complete_steps(root / "resumed" / "ckpt") == [0, 6, 12, 18, 23]
    final_p0, final_p1, full = states(root, "k4_resumed_p0", "k4_resumed_p1", "k4_p0")
    assert_same_state(final_p0, final_p1)
    assert_same_state(final_p0, full)  # the data position came back with the checkpoint


@pytest.mark.processes
@pytest.mark.slow
def test_sigterm_to_one_of_two_processes_with_4_steps_a_run_stops_both_at_one_step_and_saves_it(two_processes):
    root = two_processes[0]
    p0, p1 = both(two_processes, "k4_sigterm")
    assert p0["preempted"] and p1["preempted"], (p0, p1)
    # JAX's preemption sync step is polled for every step of a run, not only the run's last: both stop at the
    # end of the run that holds it, well before step 400
    assert p0["step"] == p1["step"] < 400 and p0["lengths"] == p1["lengths"], (p0, p1)
    assert p0["lengths"] == [1] + [4] * (len(p0["lengths"]) - 1)  # the first run is an agreement point
    assert jm.latest_checkpoint_step(root / "sigterm") == p0["step"]
    assert_same_state(*states(root, "k4_sigterm_p0", "k4_sigterm_p1"))


if __name__ == "__main__":
    if sys.argv[1] == "mesh":
        mesh_main(sys.argv[2])
    else:
        worker_main(int(sys.argv[2]), sys.argv[3], sys.argv[4])
