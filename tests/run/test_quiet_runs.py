"""A quiet run (every hook asleep, nothing fetched) copies nothing implicitly, in either
direction: its batches went to the device ahead of it (stacked on the host for a run of
several steps, one copy a run), and nothing else crosses. On a GPU such a copy inside a
dispatch waits for the device's queue, a wait a CPU run does not show; JAX's own guard,
`jax.transfer_guard("disallow")`, raises on it on the CPU too.

Every run length (1, 8, 32) and both program choices ("auto": on the CPU one program
for every length; 1: one per length, as on a GPU), with the default set of
`MonitoredTrainingSession`, a `LoggingHook`, a `NanHook` and an `EvalHook` asleep; data
from an iterator and from `jm.ArrayDataSource`; and on 8 simulated devices (a child
process running this file as a script).
"""

from __future__ import annotations

import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import warm_processes
from helpers import cpu_env, with_helpers_path

import jaxmon as jm

QUIET_RUNS = 3
ROWS = 8


def init_fn():
    return {"w": jnp.ones((4,), jnp.float32)}


def step_fn(state, batch):
    loss = jnp.mean((batch["x"] @ state["w"] - batch["y"]) ** 2)
    grad = jax.grad(lambda w: jnp.mean((batch["x"] @ w - batch["y"]) ** 2))(state["w"])
    return {"w": state["w"] - 0.01 * grad}, {"loss": loss}


def eval_fn(state, batch):
    return {"loss": jnp.mean((batch["x"] @ state["w"] - batch["y"]) ** 2)}


def rows(count, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(count, 4)).astype(np.float32)
    return {"x": x, "y": x.sum(1).astype(np.float32)}


def endless():
    """Host batches of ROWS rows, each new, for ever."""
    for seed in range(10**6):
        yield rows(ROWS, seed)


def session(directory, k, scan_unroll, data, **kwargs):
    """The default set (summaries, step counter, checkpoints, perf) with a log line, a NaN
    check and an evaluation, every trigger past the runs the test makes."""
    hooks = [jm.LoggingHook(["loss"], every_n_iter=1000), jm.NanHook("loss", every_n_steps=1000),
             jm.EvalHook(eval_fn, [rows(ROWS, 10**7)], every_n_steps=1000)]
    return jm.MonitoredTrainingSession(step_fn, init_fn, data=data, checkpoint_dir=str(directory), hooks=hooks,
                                       steps_per_dispatch=k, scan_unroll=scan_unroll, save_summaries_steps=1000,
                                       log_step_count_steps=1000, **kwargs)


def quiet_runs(sess):
    """Runs `sess` past its first triggers (step 1's summaries) and compilations, then
    QUIET_RUNS runs under `jax.transfer_guard("disallow")`; returns the steps they took."""
    for _ in range(3):
        sess.run()
    compiled, before = sess.compile_count, sess.step
    with jax.transfer_guard("disallow"):
        for _ in range(QUIET_RUNS):
            sess.run()
    assert sess.compile_count == compiled
    return sess.step - before


@pytest.mark.parametrize("scan_unroll", ["auto", 1])
@pytest.mark.parametrize("k", [1, 8, 32])
def test_quiet_runs_of_every_length_and_program_choice_copy_nothing_implicitly(k, scan_unroll, tmp_path):
    with session(tmp_path, k, scan_unroll, endless()) as sess:
        assert quiet_runs(sess) == QUIET_RUNS * k


@pytest.mark.parametrize(("k", "scan_unroll"), [(1, "auto"), (8, "auto"), (8, 1)])
def test_quiet_runs_on_an_array_data_source_copy_nothing_implicitly(k, scan_unroll, tmp_path):
    data = jm.ArrayDataSource(rows(4096), batch_size=ROWS, seed=1)
    with session(tmp_path, k, scan_unroll, data) as sess:
        assert quiet_runs(sess) == QUIET_RUNS * k


def test_runs_the_hooks_end_otherwise_than_foreseen_copy_nothing_implicitly_either(tmp_path):
    """Runs placed ahead whose length a hook's schedule changes: each is placed again when
    it is due (explicitly), before its dispatch."""

    class Moves(jm.Hook):  # acts at a step it chooses after each of its runs: 5, then 11
        def __init__(self):
            self.at = 5

        def next_trigger(self, step):
            return jm.Trigger(self.at)

        def after_run(self, ctx, values):
            if values.step == self.at:
                self.at += 6

    with jm.MonitoredSession(step_fn, init_fn, data=endless(), hooks=[Moves(), jm.StopAtStepHook(last_step=24)],
                             steps_per_dispatch=8) as sess:
        sess.run()
        lengths = []
        with jax.transfer_guard("disallow"):
            while not sess.should_stop():
                before = sess.step
                sess.run()
                lengths.append(sess.step - before)
    assert lengths == [1, 4, 2, 4, 2, 4, 2, 1]  # after step 4: to 5, then to 11, 17 and 23 in 4 + 2, then 24


# -- 8 simulated devices: a child process ---------------------------------------------------------


def mesh_quiet_runs(root):
    """On a data-parallel mesh of 8 devices: the steps of the quiet runs, or the error, by case."""
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    results = {}
    for k, scan_unroll in [(1, "auto"), (8, "auto"), (8, 1)]:
        name = f"k{k}-{scan_unroll}"
        try:
            with session(f"{root}/{name}", k, scan_unroll, endless(), mesh=mesh) as sess:
                results[name] = quiet_runs(sess)
        except Exception as error:  # noqa: BLE001 - reported to the test
            results[name] = f"{type(error).__name__}: {error}"[:2000]
    return results


@pytest.mark.slow
def test_quiet_runs_on_8_simulated_devices_copy_nothing_implicitly(tmp_path):
    process = warm_processes.run([sys.executable, __file__, str(tmp_path)], env=with_helpers_path(cpu_env(devices=8)),
                                 capture_output=True, text=True, timeout=300)
    assert process.returncode == 0, process.stderr[-4000:]
    results = json.loads(process.stdout.strip().splitlines()[-1])
    assert results == {"k1-auto": QUIET_RUNS, "k8-auto": QUIET_RUNS * 8, "k8-1": QUIET_RUNS * 8}


if __name__ == "__main__":
    print(json.dumps(mesh_quiet_runs(sys.argv[1])))
