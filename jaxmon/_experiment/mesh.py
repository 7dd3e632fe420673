"""The `mesh` and `sharding` sections: the devices a run trains on and where each part
of its state and its batches lives.

  mesh: {"data": -1, "fsdp": 2, "tensor": 1}   # named axes with sizes; -1: the devices left
  sharding: {"rules": [["embed", "fsdp"], ["mlp", "tensor"], ...],  # Flax logical-axis rules
             "fsdp": "fsdp",             # shard every other parameter on its largest dimension
             "batch": ["data", "fsdp"]}  # the axes a batch's leading axis splits over

A parameter annotated with `nn.with_logical_partitioning` is placed by `rules`, and its
optimizer state with it; with `fsdp` (a mesh axis), every parameter the rules leave
whole is split over that axis on its largest dimension that divides, and its optimizer
state with it (fully sharded data parallelism). Everything else is replicated.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import flax.linen as nn
import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxmon._base.errors import ConfigError
from jaxmon._experiment.tasks import TaskContext, boxed_params
from jaxmon._run.train_state import TrainState

__all__ = ["Layout", "ShardingError", "layout_of", "mesh_of"]


class ShardingError(ConfigError):
    """A parameter or a batch cannot be split as the mesh and the rules say."""


def mesh_of(spec: Any) -> Mesh | None:
    """The mesh of the `mesh` section; None without one on a single process, a `data`
    axis over every device with several processes.

    Raises:
      ConfigError: `spec` is not a dict of axis sizes that multiply to the device count.
    """
    if spec is None:
        return None if jax.process_count() == 1 else mesh_of({"data": -1})
    if not isinstance(spec, Mapping) or not spec or not all(isinstance(k, str) for k in spec):
        raise ConfigError(f"mesh must be a dict of axis names and sizes, e.g. {{'data': -1, 'fsdp': 2}}; got {spec!r}.")
    sizes = dict(spec)
    bad = {k: v for k, v in sizes.items() if not isinstance(v, int) or isinstance(v, bool) or (v < 1 and v != -1)}
    if bad or list(sizes.values()).count(-1) > 1:
        raise ConfigError(f"mesh={spec!r}: every size must be an int >= 1, and at most one -1 (the devices left).")
    devices = jax.device_count()
    known = math.prod(v for v in sizes.values() if v != -1)
    if -1 in sizes.values():
        if devices % known:
            raise ConfigError(f"mesh={spec!r}: the other axes take {known} devices, which does not divide the "
                              f"{devices} devices this run has. Run it on {known} devices{_simulated(known)}, or "
                              f"shrink the other axes to divide {devices}: {_shrunk(sizes, devices)}.")
        sizes = {k: (devices // known if v == -1 else v) for k, v in sizes.items()}
    if math.prod(sizes.values()) != devices:
        raise ConfigError(f"mesh={spec!r} needs {math.prod(sizes.values())} devices; this run has {devices} "
                          f"({jax.process_count()} process(es)). Set one axis to -1 to take the devices left, or "
                          f"run it on {math.prod(sizes.values())} devices{_simulated(math.prod(sizes.values()))}.")
    return jax.make_mesh(tuple(sizes.values()), tuple(sizes), axis_types=(AxisType.Auto,) * len(sizes))


def _simulated(count: int) -> str:
    """On a CPU, how to simulate `count` devices ("" elsewhere)."""
    if jax.devices()[0].platform != "cpu":
        return ""
    return f" (on a CPU: XLA_FLAGS=--xla_force_host_platform_device_count={count})"


def _shrunk(sizes: Mapping[str, int], devices: int) -> str:
    """The overrides that shrink the fixed axes of `sizes` (one is -1) until their product
    divides `devices`: each to its greatest common divisor with the devices left."""
    left, overrides = devices, []
    for axis, size in sizes.items():
        if size == -1:
            continue
        fits = math.gcd(size, left)
        if fits != size:
            overrides.append(f"--config.mesh.{axis}={fits}")
        left //= fits
    return " ".join(overrides)


class Layout:
    """Where a run's state and batches live on `mesh`: one `PartitionSpec` per state
    leaf, and the batch's.

    Args:
      mesh: the run's mesh.
      state_specs: a PartitionSpec per leaf of the state (its structure).
      batch_axes: the mesh axes a batch's leading axis splits over.
    """

    def __init__(self, mesh: Mesh, state_specs: Any, batch_axes: tuple[str, ...]):
        self.mesh, self.state_specs, self.batch_axes = mesh, state_specs, batch_axes

    @property
    def state_shardings(self) -> Any:
        return jax.tree.map(lambda spec: NamedSharding(self.mesh, spec), self.state_specs, is_leaf=_is_spec)

    @property
    def batch_sharding(self) -> P:
        return P(self.batch_axes)

    def sharded_init(self, init_fn: Callable[[], Any]) -> Callable[[], Any]:
        """`init_fn` jitted to build each leaf of the state on its own devices (the session keeps them)."""
        return jax.jit(init_fn, out_shardings=self.state_shardings)

    def check(self, abstract: Any, batch_size: int) -> None:
        """Raises a `ShardingError` naming the first leaf of `abstract` (the state's shapes)
        with a dimension that its mesh axes do not divide, or a batch they do not divide."""
        for (path, leaf), spec in zip(jax.tree_util.tree_leaves_with_path(abstract),
                                      jax.tree.leaves(self.state_specs, is_leaf=_is_spec), strict=True):
            name = "state" + jax.tree_util.keystr(path)
            shape = tuple(np.shape(leaf))
            for dim, axes in enumerate(spec):
                size = self._size(axes)
                if dim >= len(shape) or shape[dim] % size:
                    held = f"size {shape[dim]}" if dim < len(shape) else "missing"
                    raise ShardingError(
                        f"{name} of shape {shape} cannot be split over mesh axis {_names(axes)} ({size} devices): "
                        f"dimension {dim} is {held}. Change the model (a size divisible by {size}), the mesh, or "
                        "the sharding rules that map its logical axis there.")
        size = self._size(self.batch_axes)
        if batch_size % size or batch_size % jax.process_count():
            raise ShardingError(f"data.batch_size={batch_size} cannot be split over mesh axes "
                                f"{_names(self.batch_axes)} ({size} devices) and {jax.process_count()} process(es): "
                                f"give a multiple of {math.lcm(size, jax.process_count())}.")

    def _size(self, axes: Any) -> int:
        names = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
        return math.prod(self.mesh.shape[name] for name in names)


def _names(axes: Any) -> str:
    return repr(axes) if isinstance(axes, str) else "+".join(map(repr, axes or ()))


def _is_spec(x: Any) -> bool:
    return isinstance(x, P)


def layout_of(config: Mapping[str, Any], mesh: Mesh, context: TaskContext, init_fn: Callable[[], Any],
              built_in: bool) -> Layout:
    """The layout of the `sharding` section on `mesh`, for the state `init_fn` builds.

    Args:
      config: the experiment config.
      mesh: the run's mesh.
      context: the task's context (the model whose logical axes the rules map).
      init_fn: the task's `init_fn` (traced, not run).
      built_in: whether the state is the built-in tasks' `TrainState` of `context.model`
        (whose annotated parameters the rules place, with their optimizer state).

    Raises:
      ConfigError: a key of `sharding` is unknown or names an axis the mesh lacks.
    """
    spec = config.get("sharding") or {}
    if not isinstance(spec, Mapping):
        raise ConfigError(f"sharding must be a dict with rules, fsdp and batch; got {spec!r}.")
    unknown = sorted(set(spec) - {"rules", "fsdp", "batch"})
    if unknown:
        raise ConfigError(f"sharding.{unknown[0]} is not a sharding key; give rules, fsdp or batch.")
    rules = _rules(spec.get("rules") or (), mesh)
    fsdp = spec.get("fsdp")
    if fsdp is not None and fsdp not in mesh.axis_names:
        raise ConfigError(f"sharding.fsdp={fsdp!r} is not an axis of the mesh {dict(mesh.shape)}.")
    batch = spec.get("batch", mesh.axis_names)
    batch = (batch,) if isinstance(batch, str) else tuple(batch)
    for name in batch:
        if name not in mesh.axis_names:
            raise ConfigError(f"sharding.batch names {name!r}, which is not an axis of the mesh {dict(mesh.shape)}.")
    abstract = jax.eval_shape(init_fn)
    specs = jax.tree.map(lambda _: P(), abstract)
    if built_in and rules and context.model is not None:
        boxed = boxed_params(context)
        state = jax.eval_shape(lambda: TrainState.create(apply_fn=context.model.apply, params=boxed,
                                                         tx=context.optimizer))
        with nn.logical_axis_rules(rules):
            specs = nn.logical_to_mesh(nn.get_partition_spec(state), rules)
        specs = jax.tree.map(lambda s: P(*s), specs, is_leaf=_is_spec)
    if fsdp is not None:
        specs = jax.tree.map(lambda s, leaf: _fsdp(s, np.shape(leaf), fsdp, mesh.shape[fsdp]), specs, abstract,
                             is_leaf=_is_spec)
    return Layout(mesh, specs, batch)


def _rules(rules: Any, mesh: Mesh) -> tuple[tuple[str, Any], ...]:
    """The `sharding.rules` as Flax logical-axis rules, each mesh axis checked."""
    checked = []
    for rule in rules:
        if not (isinstance(rule, Sequence) and not isinstance(rule, str) and len(rule) == 2
                and isinstance(rule[0], str)):
            raise ConfigError(f"sharding.rules holds {rule!r}: give [logical axis, mesh axis or list or None] pairs, "
                              "e.g. ['embed', 'fsdp'].")
        target = rule[1]
        names = () if target is None else (target,) if isinstance(target, str) else tuple(target)
        for name in names:
            if name not in mesh.axis_names:
                raise ConfigError(f"sharding.rules maps {rule[0]!r} to {name!r}, which is not an axis of the mesh "
                                  f"{dict(mesh.shape)}.")
        checked.append((rule[0], target if target is None or isinstance(target, str) else tuple(target)))
    return tuple(checked)


def _fsdp(spec: P, shape: tuple[int, ...], axis: str, size: int) -> P:
    """`spec`, or for a leaf no rule splits, `axis` on its largest dimension that `size` divides."""
    if any(entry is not None for entry in spec) or not shape:
        return spec
    dims = sorted((d for d in range(len(shape)) if shape[d] % size == 0 and shape[d] >= size),
                  key=lambda d: -shape[d])
    if not dims:
        return spec
    entries = [None] * len(shape)
    entries[dims[0]] = axis
    return P(*entries)
