"""examples/mixed_precision.py: bfloat16 compute keeps float32's accuracy and float32 checkpoints."""

import importlib.util
import pathlib
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import warm_processes
from helpers import cpu_env

import jaxmon as jm

ROOT = pathlib.Path(__file__).resolve().parents[1]
LINE = re.compile(r"test accuracy ([\d.]+) \(compute (\w+), params float32, (\d+) steps\)")


def load_example():
    """The example as a module, imported in-process, for its step and config."""
    spec = importlib.util.spec_from_file_location("mixed_precision", ROOT / "examples" / "mixed_precision.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def example():
    return load_example()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One full run (the default 1500 steps) per compute dtype, as a user runs the
    example (XLA's default optimisations: bfloat16 on the CPU is emulated, and costs
    half as much again without them): {dtype: (workdir, last printed line)}."""
    results = {}
    for dtype in ("float32", "bfloat16"):
        workdir = tmp_path_factory.mktemp(dtype)
        done = warm_processes.run([sys.executable, str(ROOT / "examples" / "mixed_precision.py"), "--dtype", dtype,
                                   "--workdir", str(workdir)], cwd=ROOT, env={**cpu_env(), "XLA_FLAGS": ""},
                                  capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        results[dtype] = workdir, done.stdout.strip().splitlines()[-1]
    return results


def test_the_example_trains_the_default_experiment(example):
    config = jm.load_config(ROOT / "configs" / "default.py")
    ours = example.CONFIG
    assert config["data"]["source"] == "jaxmon.datasets:digits" and config["model"]["name"] == "jaxmon.models:CNN"
    assert (ours["steps"], ours["batch_size"], ours["seed"]) == (config["steps"], config["data"]["batch_size"],
                                                                 config["seed"])
    assert config["optimizer"] == {"name": "adam", "learning_rate": ours["learning_rate"]}
    assert (list(ours["channels"]), list(ours["features"])) == (config["model"]["channels"],
                                                                config["model"]["features"])


@pytest.mark.slow
def test_bfloat16_accuracy_is_within_a_point_of_float32(runs):
    accuracies = {}
    for dtype, (workdir, line) in runs.items():
        match = LINE.fullmatch(line)
        assert match, line
        assert match[2] == dtype and int(match[3]) == jm.latest_checkpoint_step(workdir) == 1500
        accuracies[dtype] = float(match[1])
    assert accuracies["float32"] > 0.95  # ten classes: chance is 0.1
    assert abs(accuracies["bfloat16"] - accuracies["float32"]) <= 0.01, accuracies


def floating_leaves(tree) -> dict[str, np.dtype]:
    """{path: dtype} of the floating-point leaves of `tree` (arrays or `jax.ShapeDtypeStruct`s)."""
    leaves = jax.tree_util.tree_leaves_with_path(tree)
    return {jax.tree_util.keystr(path): np.dtype(leaf.dtype) for path, leaf in leaves
            if jnp.issubdtype(leaf.dtype, jnp.floating)}


def test_the_bfloat16_checkpoint_holds_float32_params_and_optimizer_state(runs):
    restored = jm.restore_checkpoint(runs["bfloat16"][0])
    assert restored.step == 1500
    for field in ("params", "opt_state"):
        dtypes = floating_leaves(restored.state[field])
        assert len(dtypes) >= 8, dtypes  # 4 layers' kernel and bias (and Adam's mu, nu of each)
        assert set(dtypes.values()) == {np.dtype(np.float32)}, dtypes
    # bfloat16 compute did change the training: same layout as the float32 run, other values.
    reference = jm.restore_checkpoint(runs["float32"][0]).state["params"]
    assert jax.tree.structure(reference) == jax.tree.structure(restored.state["params"])
    assert not all(np.array_equal(a, b) for a, b in
                   zip(jax.tree.leaves(reference), jax.tree.leaves(restored.state["params"]), strict=True))


def compute_dtypes(example, dtype) -> tuple[list[str], dict]:
    """The output dtypes of the step's convolutions and matmuls (forward and backward),
    and the dtypes of what the step returns."""
    state = example.init_fn()
    batch = next(jm.ArrayDataSource(jm.datasets.digits("train"), batch_size=64))
    step_fn = example.make_step(dtype)
    jaxpr = str(jax.make_jaxpr(step_fn)(state, batch))
    ops = re.findall(r":(\w+)\[[\d,]*\] = (?:conv_general_dilated|dot_general)\[", jaxpr)
    new_state, outputs = jax.eval_shape(step_fn, state, batch)
    return ops, {"params": floating_leaves(new_state.params), "loss": outputs["loss"].dtype}


def test_the_step_computes_in_bfloat16_and_returns_float32(example):
    ops, returned = compute_dtypes(example, jnp.bfloat16)
    # 2 convolutions and 2 dense layers forward, 7 of their gradients backward: 11 ops, all bfloat16.
    assert len(ops) == 11 and set(ops) == {"bf16"}, ops
    assert set(returned["params"].values()) == {np.dtype(np.float32)} and returned["loss"] == np.float32
    ops, _ = compute_dtypes(example, jnp.float32)
    assert len(ops) == 11 and set(ops) == {"f32"}, ops
