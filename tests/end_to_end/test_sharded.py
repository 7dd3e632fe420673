"""Sharded sessions (`mesh=`, `state_sharding=`, `batch_sharding=`, `max_dispatch_ahead=`)
on 8 simulated CPU devices, against the same training on one device.

The 8-device work runs in ONE subprocess: this file run as a script
(`python tests/end_to_end/test_sharded.py ROOT`) with
`XLA_FLAGS=--xla_force_host_platform_device_count=8`; it writes `ROOT/results.json`
and `.npz` files of state leaves, which the tests below read. The pytest process keeps
its single device and trains the references, writes the 1-device checkpoint the child
restores onto 8 devices, and restores the child's 8-device checkpoint onto 1 device.
Each scenario of the child records its own error, so one failure fails only its tests.
"""

from __future__ import annotations

import itertools
import json
import os
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import warm_processes
from helpers import ROOT, cpu_env, window_means, with_helpers_path
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxmon as jm

CHILD_ENV = with_helpers_path(cpu_env(devices=8))  # the references of this process may be on a GPU
TOTAL, SAVED_AT, DISPATCH_STEPS = 30, 20, 220
RTOL, ATOL = 1e-5, 1e-6  # matmuls at float32 precision in both processes (conftest.py, child_main)

# -- the model, shared by this process (1 device) and the child (8 devices) -----------------

TX = optax.adam(1e-2)


def init_params():
    k1, k2 = jax.random.split(jax.random.PRNGKey(0))
    return {"w1": jax.random.normal(k1, (4, 16)) * 0.5, "b1": jnp.zeros((1, 16)),
            "w2": jax.random.normal(k2, (16, 1)) * 0.5, "b2": jnp.zeros((1, 1))}


def init_fn():
    params = init_params()
    return {"params": params, "opt": TX.init(params)}


def loss_fn(params, batch):
    hidden = jnp.tanh(batch["x"] @ params["w1"] + params["b1"])
    return jnp.mean((hidden @ params["w2"] + params["b2"] - batch["y"]) ** 2)  # a mean over the split batch


def step_fn(state, batch):
    loss, grads = jax.value_and_grad(loss_fn)(state["params"], batch)
    updates, opt = TX.update(grads, state["opt"], state["params"])
    return {"params": optax.apply_updates(state["params"], updates), "opt": opt}, {"loss": loss}


def train_state_init():
    return jm.TrainState.create(apply_fn=None, params=init_params(), tx=TX)


def train_state_step(state, batch):
    loss, grads = jax.value_and_grad(loss_fn)(state.params, batch)
    return state.apply_gradients(grads=grads), {"loss": loss}


def make_data():
    """96 rows, batches of 32 (4 rows per device on 8, 8 on 4), reshuffled each epoch."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(96, 4)).astype(np.float32)
    return jm.ArrayDataSource({"x": x, "y": np.sin(x.sum(1, keepdims=True))}, batch_size=32, seed=3)


#: A non-trivial state sharding, as a prefix pytree: w1's columns split 8 (or 4) ways.
#: Used on meshes with Auto axes: on `jax.make_mesh`'s default Explicit axes, JAX itself
#: refuses `x[32@data, 4] @ w1[4, 16@data]` in the step (sharding in types).
DICT_SPEC = {"params": {"w1": P(None, "data"), "b1": P(), "w2": P(), "b2": P()}, "opt": P()}


def split_wide(abstract_state):
    """A state_sharding function: every 2-D leaf with 16 columns (w1, b1 and Adam's mu
    and nu of both) split by column, the rest replicated."""
    return jax.tree.map(lambda leaf: P(None, "data") if is_wide(leaf.shape) else P(), abstract_state)


def is_wide(shape):
    return len(shape) == 2 and shape[1] == 16


def flat(state):
    """{"params/w1": host array, ...} for every leaf of a state."""
    return {jax.tree_util.keystr(path, simple=True, separator="/"): np.asarray(leaf)
            for path, leaf in jax.tree_util.tree_leaves_with_path(state)}


def params_of(values):
    return {k.split("/", 1)[1]: v for k, v in values.items() if k.startswith("params/")}


def train(sess, last_step=None):
    with sess:
        while not sess.should_stop() and (last_step is None or sess.step < last_step):
            sess.run()
    return sess


# -- hooks ----------------------------------------------------------------------------------------


class LossEvery(jm.Hook):
    """Fetches the loss by name every `n` steps (read on the exact step)."""

    def __init__(self, n):
        self.n, self.losses = n, {}

    def before_run(self, ctx):
        return jm.RunArgs(fetches="loss") if (ctx.step + 1) % self.n == 0 else None

    def after_run(self, ctx, values):
        if values.results is not None:
            self.losses[values.step] = float(values.results)


class DispatchBound(jm.Hook):
    """Keeps each run's loss, unread, and after each run checks which are not computed
    yet: never one of a run `max_dispatch_ahead` or more runs back."""

    def __init__(self):
        self.pending, self.deepest, self.late = {}, 0, []

    def after_create_session(self, session):
        self.bound = session.max_dispatch_ahead

    def after_run(self, ctx, values):
        self.pending[values.step] = values.outputs["loss"]
        self.pending = {step: loss for step, loss in self.pending.items() if not loss.is_ready()}
        self.deepest = max(self.deepest, len(self.pending))
        if any(step <= values.step - self.bound for step in self.pending):
            self.late.append(values.step)


# -- a step heavy enough that the device falls behind the host: without a bound on queued
# steps, 8 simulated CPU devices abort ("Termination timeout for all reduce") ------------------

HEAVY = 512


def heavy_init():
    return {"w": jnp.full((HEAVY, HEAVY), 0.01, jnp.float32)}  # not weakly typed: one compile


def heavy_step(state, batch):
    def loss(w):
        return jnp.mean(jnp.tanh(batch["x"] @ w) ** 2)  # a mean over the split batch: an all-reduce

    value, grad = jax.value_and_grad(loss)(state["w"])
    return {"w": state["w"] - 0.1 * grad}, {"loss": value}


def heavy_batch():
    return {"x": np.random.default_rng(0).normal(size=(256, HEAVY)).astype(np.float32)}


# -- the child: 8 simulated devices -----------------------------------------------------------


def describe_shardings(state):
    out = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(state):
        sharding = leaf.sharding
        spec = getattr(sharding, "spec", None)
        out[jax.tree_util.keystr(path, simple=True, separator="/")] = {
            "type": type(sharding).__name__,
            "spec": None if spec is None else [e if e is None or isinstance(e, str) else list(e) for e in spec],
            "mesh": dict(sharding.mesh.shape) if isinstance(sharding, NamedSharding) else None,
            "devices": len(sharding.device_set),
            "shape": list(leaf.shape),
            "shard_shape": list(sharding.shard_shape(leaf.shape)),
        }
    return out


def child_main(root):
    assert jax.device_count() == 8, jax.devices()
    jax.config.update("jax_default_matmul_precision", "float32")  # as conftest.py sets for the references
    mesh8 = jax.make_mesh((8,), ("data",))
    auto8 = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
    mesh4 = jax.make_mesh((4,), ("data",), devices=jax.devices()[:4])
    auto4 = jax.make_mesh((4,), ("data",), axis_types=(AxisType.Auto,), devices=jax.devices()[:4])
    results = {"devices": jax.device_count()}

    def save(name, state):
        np.savez(os.path.join(root, f"{name}.npz"), **flat(state))

    def data_parallel():
        seen, logged = [], []

        def inspected_step(state, batch):
            jax.debug.inspect_array_sharding(
                batch["x"], callback=lambda s, shape=batch["x"].shape: seen.append(
                    [len(s.device_set), list(s.shard_shape(shape))]))
            return step_fn(state, batch)

        every = LossEvery(5)
        logging_hook = jm.LoggingHook(["loss"], every_n_iter=5, formatter=lambda v: logged.append(float(v["loss"])))
        sess = jm.MonitoredSession(inspected_step, init_fn, data=make_data(), mesh=mesh8,
                                   hooks=[every, logging_hook, jm.StopAtStepHook(last_step=TOTAL)])
        placed = describe_shardings(sess.state)
        caller = {}
        with sess:
            while not sess.should_stop():
                step = sess.step + 1
                if step % 10 == 0:
                    caller[step] = float(sess.run(fetches="loss"))
                else:
                    sess.run()
        save("dp", sess.state)
        return {"compile_count": sess.compile_count, "step": sess.step, "placed": placed,
                "trained": describe_shardings(sess.state), "batch_x_seen": seen, "hook_losses": every.losses,
                "logged_losses": logged, "caller_losses": caller, "max_dispatch_ahead": sess.max_dispatch_ahead,
                "loss_sharding": describe_shardings({"loss": sess.last_outputs["loss"]})["loss"]}

    def sharded(name, step, init, spec):
        sess = jm.MonitoredSession(step, init, data=make_data(), mesh=auto8, state_sharding=spec,
                                   hooks=[jm.StopAtStepHook(last_step=TOTAL)])
        placed, before = describe_shardings(sess.state), sess.state
        sess.run()
        donated = all(leaf.is_deleted() for leaf in jax.tree.leaves(before))
        after_one = describe_shardings(sess.state)
        train(sess)
        save(name, sess.state)
        return {"placed": placed, "after_one": after_one, "trained": describe_shardings(sess.state),
                "donated": donated, "compile_count": sess.compile_count, "step": sess.step}

    def save8():
        source, saver = make_data(), jm.CheckpointSaverHook(os.path.join(root, "eight"), save_steps=10)
        sess = train(jm.MonitoredSession(step_fn, init_fn, data=source, mesh=auto8, state_sharding=DICT_SPEC,
                                         hooks=[saver, jm.StopAtStepHook(last_step=SAVED_AT)]))
        save("save8", sess.state)
        return {"step": sess.step, "position": source.get_state(), "saved_steps": saver.saved_steps,
                "shardings": describe_shardings(sess.state)}

    def restore(name, directory, **placement):
        source = make_data()
        sess = jm.MonitoredSession(step_fn, init_fn, data=source, checkpoint_dir=os.path.join(root, directory),
                                   hooks=[jm.StopAtStepHook(last_step=TOTAL)], **placement)
        record = {"step": sess.step, "restored_step": sess.restored_step, "position": source.get_state(),
                  "shardings": describe_shardings(sess.state), "opt_type": type(sess.state["opt"][0]).__name__}
        save(f"{name}_restored", sess.state)
        train(sess)
        save(f"{name}_final", sess.state)
        return {**record, "final_step": sess.step, "final_shardings": describe_shardings(sess.state)}

    def restore_given_state():
        # The state given with state= (host arrays), restored and placed onto the mesh.
        sess = jm.MonitoredSession(step_fn, state=init_fn(), data=make_data(), mesh=mesh8,
                                   checkpoint_dir=os.path.join(root, "single"))
        record = {"step": sess.step, "shardings": describe_shardings(sess.state)}
        save("given_restored", sess.state)
        try:
            with sess:
                sess.run()
            record["run"] = "ok"
        except Exception as error:
            record["run"] = f"{type(error).__name__}: {error}"[:1500]
        return record

    def dispatch():
        bound = DispatchBound()
        sess = train(jm.MonitoredSession(heavy_step, heavy_init, data=itertools.repeat(heavy_batch()), mesh=mesh8,
                                         hooks=[bound, jm.StopAtStepHook(last_step=DISPATCH_STEPS)]))
        state = jax.device_put(heavy_init(), NamedSharding(mesh8, P()))
        batch = jax.device_put(heavy_batch(), NamedSharding(mesh8, P("data")))
        hlo = jax.jit(heavy_step).lower(state, batch).compile().as_text()
        return {"step": sess.step, "max_dispatch_ahead": sess.max_dispatch_ahead, "deepest": bound.deepest,
                "late": bound.late, "loss": float(sess.last_outputs["loss"]), "all_reduce": "all-reduce" in hlo,
                "compile_count": sess.compile_count}

    def defaults():
        def bound(**kwargs):
            with jm.MonitoredSession(step_fn, init_fn, **kwargs) as sess:
                return sess.max_dispatch_ahead

        one = jax.make_mesh((1,), ("data",), devices=jax.devices()[:1])
        return {"mesh8": bound(mesh=mesh8), "mesh4": bound(mesh=mesh4), "mesh1": bound(mesh=one),
                "none": bound(mesh=mesh8, max_dispatch_ahead=None), "three": bound(mesh=mesh8, max_dispatch_ahead=3)}

    def nan_on_mesh():
        def poisoned(state, batch):  # the loss turns NaN at step 7 (Adam's count is the step)
            state, outputs = step_fn(state, batch)
            count = optax.tree_utils.tree_get(state["opt"], "count")
            return state, {"loss": jnp.where(count == 7, jnp.nan, outputs["loss"])}

        sess = jm.MonitoredSession(poisoned, init_fn, data=make_data(), mesh=mesh8,
                                   hooks=[jm.NanHook("loss", every_n_steps=4), jm.StopAtStepHook(last_step=TOTAL)])
        try:
            train(sess)
        except jm.NanLossDuringTrainingError as error:
            return {"nan_step": error.step, "raised_at": sess.step, "compile_count": sess.compile_count}
        return {"nan_step": None, "raised_at": sess.step}

    scenarios = {
        "dp": data_parallel,
        "nan": nan_on_mesh,
        "sharded_dict": lambda: sharded("sharded_dict", step_fn, init_fn, DICT_SPEC),
        "sharded_fn": lambda: sharded("sharded_fn", train_state_step, train_state_init, split_wide),
        "save8": save8,
        "r84": lambda: restore("r84", "eight", mesh=mesh4),
        "r84_split": lambda: restore("r84_split", "eight", mesh=auto4, state_sharding=DICT_SPEC),
        "r18": lambda: restore("r18", "single", mesh=mesh8),
        "given": restore_given_state,
        "defaults": defaults,
        "dispatch": dispatch,  # last: were the queue unbounded, XLA would abort the process here
    }
    for name, scenario in scenarios.items():
        start = time.perf_counter()
        try:
            results[name] = scenario()
        except Exception:
            results[name] = {"error": traceback.format_exc()[-4000:]}
        results[name]["secs"] = round(time.perf_counter() - start, 2)
        with open(os.path.join(root, "results.json"), "w") as f:  # after each: an abort keeps the others
            json.dump(results, f)


# -- fixtures: the 1-device references, then the child ---------------------------------------------


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """The uninterrupted 1-device run (params after TOTAL steps, the loss of each step) and
    a 1-device checkpoint at SAVED_AT for the child to restore onto 8 devices."""
    assert jax.device_count() == 1
    root = tmp_path_factory.mktemp("sharded")
    losses = {}
    with jm.MonitoredSession(step_fn, init_fn, data=make_data(), hooks=[jm.StopAtStepHook(last_step=TOTAL)]) as ref:
        assert ref.max_dispatch_ahead is None
        while not ref.should_stop():
            step = ref.step + 1
            losses[step] = float(ref.run(fetches="loss"))
    source, saver = make_data(), jm.CheckpointSaverHook(root / "single", save_steps=10)
    saved = train(jm.MonitoredSession(step_fn, init_fn, data=source,
                                      hooks=[saver, jm.StopAtStepHook(last_step=SAVED_AT)]))
    assert saved.step == SAVED_AT and SAVED_AT in saver.saved_steps
    return {"root": root, "params": params_of(flat(ref.state)), "losses": losses,
            "saved": flat(saved.state), "position": source.get_state()}


@pytest.fixture(scope="module")
def child(single):
    root = single["root"]
    start = time.perf_counter()
    proc = warm_processes.run([sys.executable, os.path.abspath(__file__), str(root)], cwd=ROOT, env=CHILD_ENV,
                              capture_output=True, text=True, timeout=300)
    results = {}
    if (root / "results.json").exists():
        with open(root / "results.json") as f:
            results = json.load(f)
    assert results.get("devices") == 8, f"rc={proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    results["exit"] = f"rc={proc.returncode}\n{proc.stderr[-3000:]}"
    results["secs"] = time.perf_counter() - start
    return results


def scenario(child, name):
    assert name in child, f"the child ended before its scenario {name!r} finished: {child['exit']}"
    result = child[name]
    assert "error" not in result, f"the child's scenario {name!r} failed:\n{result['error']}"
    return result


def load(single, name):
    with np.load(single["root"] / f"{name}.npz") as data:
        return dict(data)


def assert_params_close(got, want):
    assert sorted(got) == sorted(want)
    for key in want:
        np.testing.assert_allclose(got[key], want[key], rtol=RTOL, atol=ATOL, err_msg=key)


def assert_bitwise(got, want):
    assert sorted(got) == sorted(want)
    for key in want:
        assert got[key].dtype == want[key].dtype and np.array_equal(got[key], want[key]), key


def normalized(spec):
    """A spec as a list without trailing Nones: P() and P(None,) are the same sharding."""
    spec = list(spec)
    while spec and spec[-1] is None:
        spec.pop()
    return spec


def assert_on_mesh(shardings, devices, split=lambda key, shape: False):
    """Every leaf a NamedSharding on a `devices`-device mesh; leaves with `split` split by
    column over all of it, the rest replicated."""
    assert shardings
    for key, s in shardings.items():
        assert s["type"] == "NamedSharding" and s["mesh"] == {"data": devices} and s["devices"] == devices, (key, s)
        if split(key, s["shape"]):
            assert normalized(s["spec"]) == [None, "data"], (key, s)
            assert s["shard_shape"] == [s["shape"][0], s["shape"][1] // devices], (key, s)
        else:
            assert normalized(s["spec"]) == [], (key, s)
            assert s["shard_shape"] == s["shape"], (key, s)


def w1_only(key, shape):
    return key == "params/w1"


def wide(key, shape):
    return is_wide(shape)


# -- 1: data parallelism on 8 devices ------------------------------------------------------------------


@pytest.mark.slow
def test_data_parallel_on_8_devices_matches_one_device(single, child):
    dp = scenario(child, "dp")
    assert dp["step"] == TOTAL
    assert_params_close(params_of(load(single, "dp")), single["params"])
    assert sorted(load(single, "dp")) == sorted(single["saved"])  # the same state structure


def test_data_parallel_step_compiles_once_with_hooks_fetching_the_loss_by_name(single, child):
    dp = scenario(child, "dp")
    assert dp["compile_count"] == 1
    # LossEvery (exact step), LoggingHook (late, at step 1 and every 5 steps) and the caller
    # fetched the loss by name. LossEvery's and the caller's values are the 1-device run's
    # loss of that step; the LoggingHook's (reduce="mean", the default, accumulated on the
    # mesh) the mean of the 1-device losses since its previous line: step 1, then 1-5 (the
    # line after step 1 ends no window), 6-10, ...
    hook = {int(k): v for k, v in dp["hook_losses"].items()}
    assert sorted(hook) == list(range(5, TOTAL + 1, 5))
    caller = {int(k): v for k, v in dp["caller_losses"].items()}
    assert sorted(caller) == [10, 20, 30]
    for step, loss in {**hook, **caller}.items():
        np.testing.assert_allclose(loss, single["losses"][step], rtol=RTOL, atol=ATOL, err_msg=f"step {step}")
    logged_steps = [1, *range(5, TOTAL + 1, 5)]
    means = window_means(single["losses"], logged_steps)
    for step, loss, mean in zip(logged_steps, dp["logged_losses"], means, strict=True):
        np.testing.assert_allclose(loss, mean, rtol=RTOL, atol=ATOL, err_msg=f"logged at step {step}")
    assert dp["loss_sharding"]["shard_shape"] == [] and dp["loss_sharding"]["devices"] == 8


def test_a_nan_on_8_devices_is_reported_at_its_exact_step(child):
    nan = scenario(child, "nan")
    # Checked inside the sharded step on every step; read after steps 4 and 8, a run late.
    assert nan == {"nan_step": 7, "raised_at": 9, "compile_count": 1, "secs": nan["secs"]}


def test_data_parallel_state_stays_replicated_on_the_mesh(child):
    dp = scenario(child, "dp")
    assert_on_mesh(dp["placed"], 8)
    assert_on_mesh(dp["trained"], 8)
    assert {k: s["spec"] for k, s in dp["placed"].items()} == {k: [] for k in dp["placed"]}  # placed as P()


def test_data_parallel_batch_is_split_8_ways_on_its_leading_axis(child):
    dp = scenario(child, "dp")
    # Seen inside the compiled step with jax.debug.inspect_array_sharding: a (32, 4) batch.
    assert dp["batch_x_seen"] and all(seen == [8, [4, 4]] for seen in dp["batch_x_seen"]), dp["batch_x_seen"]


# -- 2: a non-trivial state_sharding -------------------------------------------------------------------


def test_prefix_pytree_state_sharding_is_kept_across_donated_steps(single, child):
    result = scenario(child, "sharded_dict")
    for when in ("placed", "after_one", "trained"):
        assert_on_mesh(result[when], 8, split=w1_only)
    assert result["donated"]  # the placed state's buffers went to the first step
    assert result["compile_count"] == 1 and result["step"] == TOTAL
    assert_params_close(params_of(load(single, "sharded_dict")), single["params"])


def test_state_sharding_function_shards_params_and_optimizer_state(single, child):
    result = scenario(child, "sharded_fn")
    for when in ("placed", "after_one", "trained"):
        assert_on_mesh(result[when], 8, split=wide)
    assert sum(wide(key, s["shape"]) for key, s in result["trained"].items()) == 6  # w1, b1, Adam's mu and nu of both
    assert result["donated"] and result["compile_count"] == 1 and result["step"] == TOTAL
    assert_params_close(params_of(load(single, "sharded_fn")), single["params"])


# -- 3: checkpoints across device counts -------------------------------------------------------------


def test_checkpoint_saved_on_8_devices(child):
    saved = scenario(child, "save8")
    assert saved["step"] == SAVED_AT and saved["saved_steps"] == [0, 10, 20]
    assert_on_mesh(saved["shardings"], 8, split=w1_only)


@pytest.mark.parametrize("name, devices, split", [("r84", 4, None), ("r84_split", 4, w1_only), ("r18", 8, None)])
def test_checkpoint_restores_onto_another_mesh_and_training_continues(single, child, name, devices, split):
    """8 -> 4 devices (replicated, and w1 split 4 ways), 1 -> 8 devices."""
    scenario(child, "save8")
    result = scenario(child, name)
    source = "single" if name == "r18" else "save8"
    saved = single["saved"] if source == "single" else load(single, "save8")
    position = single["position"] if source == "single" else child["save8"]["position"]
    assert result["step"] == result["restored_step"] == SAVED_AT
    assert result["position"] == position  # the data resumes where the saved run was
    assert result["opt_type"] == "ScaleByAdamState"
    assert_bitwise(load(single, f"{name}_restored"), saved)
    split = split or (lambda key, shape: False)
    assert_on_mesh(result["shardings"], devices, split=split)
    assert result["final_step"] == TOTAL
    assert_on_mesh(result["final_shardings"], devices, split=split)
    final = load(single, f"{name}_final")
    assert int(final["opt/0/count"]) == TOTAL
    assert_params_close(params_of(final), single["params"])  # as if never interrupted


def test_checkpoint_from_8_devices_restores_onto_one_device(single, child):
    scenario(child, "save8")
    source = make_data()
    with jm.MonitoredSession(step_fn, init_fn, data=source, checkpoint_dir=single["root"] / "eight",
                             hooks=[jm.StopAtStepHook(last_step=TOTAL)]) as sess:
        assert sess.step == sess.restored_step == SAVED_AT
        assert source.get_state() == child["save8"]["position"]
        assert type(sess.state["opt"][0]).__name__ == "ScaleByAdamState"
        for leaf in jax.tree.leaves(sess.state):
            assert len(leaf.sharding.device_set) == 1
        assert_bitwise(flat(sess.state), load(single, "save8"))
        while not sess.should_stop():
            sess.run()
    assert sess.step == TOTAL
    assert_params_close(params_of(flat(sess.state)), single["params"])


def test_state_given_directly_is_restored_onto_the_mesh(single, child):
    result = scenario(child, "given")
    assert result["step"] == SAVED_AT
    assert_bitwise(load(single, "given_restored"), single["saved"])
    assert_on_mesh(result["shardings"], 8)
    assert result["run"] == "ok"


# -- 4: max_dispatch_ahead -------------------------------------------------------------------------------


def test_dispatch_ahead_defaults(child):
    defaults = {k: v for k, v in scenario(child, "defaults").items() if k != "secs"}
    assert defaults == {"mesh8": 16, "mesh4": 16, "mesh1": None, "none": None, "three": 3}
    with jm.MonitoredSession(step_fn, init_fn) as sess:  # this process: one device
        assert sess.max_dispatch_ahead is None


def test_hundreds_of_collective_steps_on_8_devices_run_with_a_bounded_queue(child):
    result = scenario(child, "dispatch")
    assert result["all_reduce"]  # the step really holds a collective on 8 devices
    assert result["step"] == DISPATCH_STEPS and np.isfinite(result["loss"])
    assert result["max_dispatch_ahead"] == 16 and result["compile_count"] == 1
    # After each run, only the last 16 runs may still be computing (`deepest`: most seen at once).
    assert result["late"] == [] and result["deepest"] <= 16, result


@pytest.mark.parametrize("value", [0, -1, "x", 2.5, True])
def test_bad_max_dispatch_ahead_is_refused(value):
    with pytest.raises(ValueError, match="max_dispatch_ahead"):
        jm.MonitoredSession(step_fn, init_fn, max_dispatch_ahead=value)


# -- 5: errors at the door ------------------------------------------------------------------------


@pytest.mark.parametrize("argument", ["state_sharding", "batch_sharding"])
def test_shardings_without_a_mesh_are_refused(argument):
    with pytest.raises(ValueError, match=f"{argument}.*mesh"):
        jm.MonitoredSession(step_fn, init_fn, **{argument: P()})


@pytest.mark.parametrize("spec", [
    {"params": P(), "opt": P(), "extra": P()},  # a key the state does not have
    {"params": {"w1": P()}, "opt": P()},  # keys missing
    [P(), P()],  # a list for a dict
    {"params": {"w1": {"deeper": P()}, "b1": P(), "w2": P(), "b2": P()}, "opt": P()},  # deeper than the state
    lambda abstract: {"other": P()},  # a function returning a mismatched pytree
], ids=["extra-key", "missing-keys", "list", "too-deep", "function"])
def test_state_sharding_not_shaped_like_the_state_is_refused(spec):
    mesh = jax.make_mesh((1,), ("data",))
    with pytest.raises(ValueError, match="state_sharding"):
        jm.MonitoredSession(step_fn, init_fn, mesh=mesh, state_sharding=spec)


def test_state_sharding_with_a_non_spec_leaf_is_refused_naming_it():
    # The axis name instead of P("data"): a mistake to report at the door, naming state_sharding.
    mesh = jax.make_mesh((1,), ("data",))
    with pytest.raises((ValueError, TypeError), match="state_sharding"):
        jm.MonitoredSession(step_fn, init_fn, mesh=mesh, state_sharding={"params": "data", "opt": P()})


def test_named_sharding_on_another_mesh_is_refused():
    mesh, other = jax.make_mesh((1,), ("data",)), jax.make_mesh((1,), ("model",))
    with pytest.raises(ValueError, match="another mesh"):
        jm.MonitoredSession(step_fn, init_fn, mesh=mesh, state_sharding=NamedSharding(other, P()))


@pytest.mark.parametrize("make", [lambda: "data", lambda: ("data",), jax.devices, lambda: np.array(jax.devices())],
                         ids=["name", "tuple", "device-list", "device-array"])
def test_mesh_that_is_not_a_mesh_is_refused(make):
    with pytest.raises(TypeError, match="mesh must be a jax.sharding.Mesh"):
        jm.MonitoredSession(step_fn, init_fn, mesh=make())


if __name__ == "__main__":
    child_main(sys.argv[1])
