"""A state that `init_fn` shards itself, on 8 simulated CPU devices: it keeps its
shardings without `state_sharding=`, live and restored, and an `init_fn` that enters
`jax.set_mesh` (as flax's lm1b and MaxText set up their states) resumes.

The 8-device work runs in one subprocess (this file run as a script), which writes
`ROOT/results.json`; the tests read it.
"""

from __future__ import annotations

import json
import os
import sys
import traceback

import pytest
import warm_processes
from helpers import cpu_env, with_helpers_path

STEPS = 4


def _mesh():
    import jax
    from jax.sharding import AxisType
    return jax.make_mesh((4, 2), ("fsdp", "tensor"), axis_types=(AxisType.Auto, AxisType.Auto))


def _model_parts():
    import jax
    import jax.numpy as jnp
    import optax
    tx = optax.adam(1e-2)

    def init_params():
        k1, k2 = jax.random.split(jax.random.PRNGKey(0))
        return {"w1": jax.random.normal(k1, (8, 16)), "w2": jax.random.normal(k2, (16, 1))}

    def step_fn(state, batch):
        def loss(params):
            return jnp.mean((jnp.tanh(batch["x"] @ params["w1"]) @ params["w2"] - batch["y"]) ** 2)
        value, grads = jax.value_and_grad(loss)(state["params"])
        updates, opt = tx.update(grads, state["opt"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates), "opt": opt}, {"loss": value}

    return tx, init_params, step_fn


def _batches():
    """Data with a position, so that a resumed run reads on where the first one stopped."""
    import numpy as np

    import jaxmon as jm
    rng = np.random.default_rng(0)
    arrays = {"x": rng.normal(size=(64, 8)).astype("float32"), "y": rng.normal(size=(64, 1)).astype("float32")}
    return jm.ArrayDataSource(arrays, 16, shuffle=True, seed=0)


def _specs(state):
    import jax
    return {jax.tree_util.keystr(path): str(leaf.sharding.spec)
            for path, leaf in jax.tree_util.tree_leaves_with_path(state)}


def _train(init_fn, workdir, mesh, steps):
    import jaxmon as jm
    _, _, step_fn = _model_parts()
    with jm.MonitoredTrainingSession(step_fn, init_fn, data=_batches(), mesh=mesh, checkpoint_dir=workdir,
                                     save_checkpoint_steps=2, save_summaries_steps=None,
                                     log_step_count_steps=None, hooks=[jm.StopAtStepHook(last_step=steps)]) as sess:
        while not sess.should_stop():
            sess.run()
        return sess.restored_step, _specs(sess.state), sess.state


def child_main(root):
    import jax
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxmon as jm

    mesh = _mesh()
    tx, init_params, _ = _model_parts()
    results = {}

    def jitted_init():  # shards w1 over fsdp and w2 over tensor with out_shardings, as lm1b's state setup
        def init():
            params = init_params()
            return {"params": params, "opt": tx.init(params)}
        shapes = jax.eval_shape(init)
        spec = {"w1": P("fsdp", None), "w2": P("tensor", None)}
        shardings = {"params": {k: NamedSharding(mesh, spec[k]) for k in spec},
                     "opt": jax.tree.map(lambda _: NamedSharding(mesh, P()), shapes["opt"])}
        shardings["opt"][0].mu.update({k: NamedSharding(mesh, spec[k]) for k in spec})
        shardings["opt"][0].nu.update({k: NamedSharding(mesh, spec[k]) for k in spec})
        return jax.jit(init, out_shardings=shardings)()

    def set_mesh_init():  # enters jax.set_mesh, which jax.eval_shape cannot trace
        with jax.set_mesh(mesh):
            params = init_params()
            return {"params": params, "opt": tx.init(params)}

    for name, init_fn in (("jitted", jitted_init), ("set_mesh", set_mesh_init)):
        try:
            workdir = os.path.join(root, name)
            first, live, _ = _train(init_fn, workdir, mesh, STEPS // 2)
            second, resumed, state = _train(init_fn, workdir, mesh, STEPS)
            restored = jm.restore_checkpoint(workdir, like=state)
            whole = _train(init_fn, os.path.join(root, name + "_whole"), mesh, STEPS)[2]
            results[name] = {"first": first, "second": second, "live": live, "resumed": resumed,
                             "restored": _specs(restored.state),
                             "same": all(np.array_equal(a, b) for a, b in zip(
                                 jax.tree.leaves(jax.device_get(state)), jax.tree.leaves(jax.device_get(whole)),
                                 strict=True))}
        except Exception:
            results[name] = {"error": traceback.format_exc()}
    with open(os.path.join(root, "results.json"), "w") as f:
        json.dump(results, f)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("sharded_init"))
    done = warm_processes.run([sys.executable, __file__, root], env=with_helpers_path(cpu_env(devices=8)),
                              capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    with open(os.path.join(root, "results.json")) as f:
        return json.load(f)


def _scenario(results, name):
    result = results[name]
    assert "error" not in result, result.get("error")
    return result


def test_a_state_init_fn_shards_with_out_shardings_keeps_its_shardings_live_and_restored(results):
    result = _scenario(results, "jitted")
    for specs in (result["live"], result["resumed"], result["restored"]):
        assert specs["['params']['w1']"] == "P('fsdp',)"
        assert specs["['params']['w2']"] == "P('tensor',)"
        assert specs["['opt'][0].mu['w1']"] == "P('fsdp',)"
    assert result["first"] is None and result["second"] == STEPS // 2
    assert result["same"]  # resumed bit for bit as the uninterrupted run


def test_an_init_fn_that_enters_set_mesh_resumes_from_its_checkpoint(results):
    result = _scenario(results, "set_mesh")
    assert result["first"] is None  # a fresh start
    assert result["second"] == STEPS // 2  # resumed, where tracing init_fn under jax.eval_shape would fail
    assert result["same"]


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    child_main(sys.argv[1])
