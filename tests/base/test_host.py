"""Device values read on the host (`to_host`): NumPy arrays in the tree's structure, by
the fast path for a few leaves and through `jax.device_get` for many."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmon._base import host
from jaxmon._base.host import to_host


def test_a_few_leaves_are_read_as_numpy_arrays_and_the_rest_kept_as_they_are():
    values = {"loss": jnp.float32(0.5), "step": 3, "vec": jnp.arange(3), "name": "run"}
    out = to_host(values)
    assert set(out) == set(values)
    assert isinstance(out["loss"], np.ndarray) and out["loss"] == np.float32(0.5)
    np.testing.assert_array_equal(out["vec"], np.arange(3))
    assert out["step"] == 3 and out["name"] == "run"


def test_many_leaves_go_through_device_get_in_their_structure(monkeypatch):
    calls = []
    real = jax.device_get
    monkeypatch.setattr(jax, "device_get", lambda values: (calls.append(1), real(values))[1])
    many = [jnp.full((2,), i) for i in range(host._READ_ONE_BY_ONE + 1)]
    out = to_host((many, {"x": jnp.ones(())}))
    assert calls == [1]
    assert isinstance(out, tuple) and len(out[0]) == len(many)
    assert all(isinstance(leaf, np.ndarray) for leaf in jax.tree.leaves(out))
    assert [int(leaf[0]) for leaf in out[0]] == list(range(len(many)))
    few = to_host([jnp.ones(()) for _ in range(host._READ_ONE_BY_ONE)])
    assert calls == [1] and len(few) == host._READ_ONE_BY_ONE  # a few: one by one


@pytest.mark.parametrize("values", [None, {}, [], 1.5])
def test_trees_without_arrays_come_back_unchanged(values):
    assert to_host(values) == values
