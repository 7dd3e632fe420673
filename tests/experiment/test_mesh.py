"""The `mesh` and `sharding` sections on this process's devices: the mesh of a spec, the
layout of the state (rules checked against the mesh, fsdp on a leaf's largest dimension
that divides) and of the batch, and the splits a layout refuses."""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxmon as jm
from jaxmon._experiment.mesh import Layout, ShardingError, _fsdp, _rules, layout_of, mesh_of


def init_fn():
    return {"w": jnp.zeros((8, 32)), "b": jnp.zeros((32,)), "scale": jnp.zeros(())}


def test_the_mesh_of_a_spec_takes_every_device():
    assert mesh_of(None) is None  # one process, no section: no mesh
    devices = jax.device_count()
    mesh = mesh_of({"data": -1, "model": 1})
    assert dict(mesh.shape) == {"data": devices, "model": 1} and mesh.axis_names == ("data", "model")
    assert dict(mesh_of({"data": devices}).shape) == {"data": devices}


@pytest.mark.parametrize("spec, words", [
    ([1], "mesh must be a dict of axis names and sizes, e.g. {'data': -1, 'fsdp': 2}; got [1]."),
    ({}, "mesh must be a dict of axis names and sizes"),
    ({"data": 0}, "every size must be an int >= 1, and at most one -1"),
    ({"data": -1, "model": -1}, "at most one -1"),
    ({"data": True}, "every size must be an int >= 1"),
    ({"data": jax.device_count() + 1}, f"needs {jax.device_count() + 1} devices; this run has {jax.device_count()}"),
], ids=["list", "empty", "zero", "two-left", "bool", "too-many"])
def test_a_bad_mesh_spec_is_refused_naming_it(spec, words):
    with pytest.raises(jm.ConfigError) as error:
        mesh_of(spec)
    assert words in str(error.value)


def test_a_mesh_the_devices_do_not_fit_names_the_devices_it_needs_and_the_axes_that_would_fit():
    devices, cpu = jax.device_count(), jax.devices()[0].platform == "cpu"

    def simulated(count):  # on a CPU only: how to simulate the devices
        return f" (on a CPU: XLA_FLAGS=--xla_force_host_platform_device_count={count})" if cpu else ""

    with pytest.raises(jm.ConfigError) as error:
        mesh_of({"data": -1, "fsdp": 4 * devices, "model": 1})
    assert str(error.value).endswith(
        f"which does not divide the {devices} devices this run has. Run it on {4 * devices} devices"
        f"{simulated(4 * devices)}, or shrink the other axes to divide {devices}: --config.mesh.fsdp={devices}.")
    mesh_of({"data": -1, "fsdp": devices, "model": 1})  # the shrunk mesh fits
    with pytest.raises(jm.ConfigError) as error:
        mesh_of({"data": devices + 1})
    assert str(error.value).endswith(f"or run it on {devices + 1} devices{simulated(devices + 1)}.")


def test_fsdp_splits_a_leaf_no_rule_splits_on_its_largest_dimension_that_divides():
    assert _fsdp(P(None, None), (8, 32), "fsdp", 4) == P(None, "fsdp")
    assert _fsdp(P(None, None), (30, 8), "fsdp", 4) == P(None, "fsdp")  # 30 does not divide by 4
    assert _fsdp(P(None, None), (3, 5), "fsdp", 4) == P(None, None)  # nothing does
    assert _fsdp(P(None, "model"), (8, 32), "fsdp", 4) == P(None, "model")  # a rule's split stays
    assert _fsdp(P(), (), "fsdp", 4) == P()  # a scalar
    assert _fsdp(P(None), (2,), "fsdp", 4) == P(None)  # smaller than the axis


def test_rules_are_pairs_whose_mesh_axes_the_mesh_has():
    mesh = mesh_of({"data": -1, "model": 1})
    assert _rules([["embed", "model"], ["batch", ["data", "model"]], ["vocab", None]], mesh) == (
        ("embed", "model"), ("batch", ("data", "model")), ("vocab", None))
    with pytest.raises(jm.ConfigError, match=r"sharding.rules holds 'embed': give \[logical axis, mesh axis"):
        _rules(["embed"], mesh)
    with pytest.raises(jm.ConfigError, match="maps 'embed' to 'fsdp', which is not an axis of the mesh"):
        _rules([["embed", "fsdp"]], mesh)


def test_the_layout_of_the_sharding_section():
    mesh = mesh_of({"data": -1})
    layout = layout_of({"sharding": {"fsdp": "data", "batch": "data"}}, mesh, None, init_fn, built_in=False)
    assert layout.state_specs == {"w": P(None, "data"), "b": P("data"), "scale": P()}
    assert layout.batch_axes == ("data",) and layout.batch_sharding == P(("data",))
    assert layout.state_shardings["w"] == NamedSharding(mesh, P(None, "data"))
    state = layout.sharded_init(init_fn)()
    assert state["w"].sharding == NamedSharding(mesh, P(None, "data"))
    plain = layout_of({}, mesh, None, init_fn, built_in=False)  # no section: replicated, batches over every axis
    assert plain.state_specs == {"w": P(), "b": P(), "scale": P()} and plain.batch_axes == ("data",)


@pytest.mark.parametrize("sharding, words", [
    ("fsdp", "sharding must be a dict with rules, fsdp and batch; got 'fsdp'."),
    ({"axes": []}, "sharding.axes is not a sharding key; give rules, fsdp or batch."),
    ({"fsdp": "model"}, "sharding.fsdp='model' is not an axis of the mesh {'data': "),
    ({"batch": ["data", "model"]}, "sharding.batch names 'model', which is not an axis of the mesh"),
], ids=["not-dict", "unknown-key", "fsdp-axis", "batch-axis"])
def test_a_bad_sharding_section_is_refused_naming_the_key(sharding, words):
    with pytest.raises(jm.ConfigError) as error:
        layout_of({"sharding": sharding}, mesh_of({"data": -1}), None, init_fn, built_in=False)
    assert words in str(error.value)


def test_check_names_a_leaf_whose_spec_has_more_dimensions_than_its_shape():
    mesh = mesh_of({"data": -1})
    layout = Layout(mesh, {"w": P(None, None, "data")}, ("data",))
    with pytest.raises(ShardingError) as error:
        layout.check({"w": jax.ShapeDtypeStruct((8, 32), jnp.float32)}, batch_size=16)
    assert str(error.value).startswith("state['w'] of shape (8, 32) cannot be split over mesh axis 'data' (")
    assert "dimension 2 is missing" in str(error.value)
    assert isinstance(error.value, jm.ConfigError)
    Layout(mesh, {"w": P(None, "data")}, ("data",)).check({"w": jax.ShapeDtypeStruct((8, 32), jnp.float32)},
                                                          batch_size=jax.device_count() * 4)
