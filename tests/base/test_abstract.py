"""Abstract values of trees and of a run's batches: shapes, dtypes, weak types and
shardings as a call with the real values would compile them."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jaxmon._base.abstract import abstract, abstract_run, one_step


def mesh_sharding(*spec):
    mesh = jax.make_mesh((1,), ("data",))
    return NamedSharding(mesh, PartitionSpec(*spec))


def test_leaves_become_shape_dtype_structs_with_weak_types_and_committed_shardings():
    committed = jax.device_put(jnp.ones((4, 2)), mesh_sharding("data"))
    tree = {"x": np.zeros((3,), np.int32), "weak": jnp.asarray(1.0), "placed": committed, "plain": jnp.ones(2)}
    out = abstract(tree)
    assert all(isinstance(leaf, jax.ShapeDtypeStruct) for leaf in jax.tree.leaves(out))
    assert (out["x"].shape, out["x"].dtype, out["x"].sharding) == ((3,), np.int32, None)
    assert out["weak"].weak_type and not out["x"].weak_type
    assert out["placed"].sharding == committed.sharding
    assert out["plain"].sharding is None  # not committed: placed where the call puts it


def test_the_abstract_values_lower_to_the_program_the_real_ones_compile():
    def f(tree):
        return tree["a"] * 2 + tree["b"]

    real = {"a": jnp.ones((2, 3)), "b": jnp.asarray(1.0)}
    assert jax.jit(f).lower(abstract(real)).as_text() == jax.jit(f).lower(real).as_text()


def test_one_step_of_a_single_batch_a_list_and_a_stacked_run():
    batch = {"x": jnp.ones((8, 3))}
    assert one_step(batch, 1)["x"].shape == (8, 3)
    assert one_step([batch, batch], 2)["x"].shape == (8, 3)  # a list of batches on the device
    stacked = {"x": jnp.ones((4, 8, 3)), "y": jnp.zeros((4,), jnp.int32)}
    step = one_step(stacked, 4)
    assert (step["x"].shape, step["y"].shape, step["y"].dtype) == ((8, 3), (), jnp.int32)


def test_a_run_stacks_one_step_and_keeps_the_steps_axis_whole_on_a_mesh():
    one = {"x": jax.ShapeDtypeStruct((8, 3), jnp.float32, sharding=mesh_sharding("data")),
           "y": jax.ShapeDtypeStruct((8,), jnp.int32)}
    run = abstract_run(one, 5)
    assert (run["x"].shape, run["y"].shape) == ((5, 8, 3), (5, 8))
    assert run["x"].sharding.spec == PartitionSpec(None, "data") and run["y"].sharding is None
    stacked = jax.device_put(jnp.ones((5, 8, 3)), mesh_sharding(None, "data"))  # such a run, on the device
    back = one_step({"x": stacked}, 5)
    assert back["x"].shape == (8, 3) and back["x"].sharding.spec == PartitionSpec("data")
