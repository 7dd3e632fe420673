"""Meshes with Explicit axes (`jax.make_mesh`'s default since JAX 0.10) and Auto axes.

On Explicit axes JAX types every value with its sharding and refuses an ambiguous
one; the session adds a note that names the mesh's Explicit axes and the fixes. The
same step on an Auto mesh trains, with the same result as without a mesh.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import jaxmon as jm


def project(state, batch):
    """x[8@data, 4] @ w[4, 16@data]: the result would be sharded twice over "data"."""
    y = batch["x"] @ state["w"]
    return {"w": state["w"] - 0.01 * y.mean()}, {"loss": jnp.mean(y ** 2)}


def batch():
    return {"x": np.linspace(0, 1, 32, dtype=np.float32).reshape(8, 4)}


def test_a_sharding_refused_on_explicit_axes_says_which_axes_and_how_to_fix_it():
    mesh = jax.make_mesh((1,), ("data",), axis_types=(AxisType.Explicit,))
    sess = jm.MonitoredSession(project, state={"w": jnp.ones((4, 16))}, mesh=mesh,
                               state_sharding={"w": P(None, "data")})
    with pytest.raises(Exception, match="illegally sharded") as raised:
        sess.run(batch())
    assert type(raised.value).__name__ == "ShardingTypeError"
    [note] = [note for note in raised.value.__notes__ if note.startswith("(jaxmon)")]
    assert "Explicit axes ['data']" in note
    assert "jax.make_mesh((1,), ('data',), axis_types=(jax.sharding.AxisType.Auto,) * 1)" in note
    assert "out_sharding=" in note and "auto_axes" in note
    sess.close()


def test_the_same_step_on_auto_axes_trains_as_without_a_mesh():
    mesh = jax.make_mesh((1,), ("data",), axis_types=(AxisType.Auto,))
    results = []
    for kwargs in ({"mesh": mesh, "state_sharding": {"w": P(None, "data")}}, {}):
        with jm.MonitoredSession(project, state={"w": jnp.ones((4, 16))}, **kwargs) as sess:
            losses = [float(sess.run(batch(), fetches="loss")) for _ in range(3)]
        results.append((losses, np.asarray(sess.state["w"])))
    (sharded, w_sharded), (plain, w_plain) = results
    assert sharded == plain and sharded[0] > sharded[-1]
    np.testing.assert_array_equal(w_sharded, w_plain)
