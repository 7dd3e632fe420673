"""Where a sharded session keeps its state and puts its batches: a mesh and two specs."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

#: Steps a session may queue without waiting for one, by default, when several CPU
#: devices run collectives: XLA aborts when ~50 programs with collectives are queued
#: on simulated CPU devices (measured: 16-32 is safe).
CPU_DISPATCH_AHEAD = 16


try:  # JAX's error for a sharding its explicit-axes typing refuses (jax.errors does not export it)
    from jax._src.core import ShardingTypeError as _SHARDING_TYPE_ERROR
except ImportError:  # a JAX without it raises none
    _SHARDING_TYPE_ERROR = type(None)


def note_explicit_axes(error: Exception, mesh: Mesh) -> None:
    """Adds to JAX's refusal of a sharding in the step (`error`), on a mesh with Explicit
    axes (`jax.make_mesh`'s default since JAX 0.10), what to do about it; any other
    error, or a mesh without them, is left as it is."""
    explicit = [name for name, kind in zip(mesh.axis_names, mesh.axis_types, strict=True)
                if kind == jax.sharding.AxisType.Explicit]
    if isinstance(error, _SHARDING_TYPE_ERROR) and explicit:
        error.add_note(_explicit_axes_note(mesh, explicit))


def _explicit_axes_note(mesh: Mesh, explicit: list[str]) -> str:
    return (f"(jaxmon) The session's mesh has Explicit axes {explicit} (jax.make_mesh's default): JAX then "
            "checks the sharding of every value the step computes, and refuses the operation above. Either "
            "build the mesh with Auto axes, to let XLA choose shardings as before: "
            f"jax.make_mesh({tuple(mesh.axis_sizes)}, {tuple(mesh.axis_names)}, "
            f"axis_types=(jax.sharding.AxisType.Auto,) * {len(mesh.axis_names)}); or say in the step what the "
            "result's sharding is (out_sharding= of the operation, jax.sharding.reshard), or compute that "
            "part with jax.sharding.auto_axes.")


def _is_spec(x: Any) -> bool:
    return x is None or isinstance(x, (PartitionSpec, NamedSharding))


class Placement:
    """The shardings of a session on `mesh`.

    Args:
      mesh: the `jax.sharding.Mesh` the state and batches live on.
      state_sharding: how to shard the state: None (each leaf keeps the
        `NamedSharding` on `mesh` that `init_fn` gave it, e.g. with
        `jax.jit(init, out_shardings=...)`; other leaves are replicated on every
        device), one `PartitionSpec` / `NamedSharding` for every leaf, a pytree of
        them that is a prefix of the state's (e.g. `{"params": P(), "opt": P()}`), or
        a function `abstract_state -> such a pytree`.
      batch_sharding: the same for the batch; None shards the leading axis of every
        batch array over all the mesh's axes (data parallelism) and replicates scalars.
    """

    def __init__(self, mesh: Mesh, state_sharding: Any = None, batch_sharding: Any = None):
        if not isinstance(mesh, Mesh):
            raise TypeError(f"mesh must be a jax.sharding.Mesh, e.g. jax.make_mesh(({jax.device_count()},), "
                            f"('data',)); got {mesh!r}.")
        self.mesh = mesh
        self._state_spec = state_sharding
        self._batch_spec = batch_sharding

    @property
    def keeps_shardings(self) -> bool:
        """Whether the state keeps the shardings `init_fn` gives it (no `state_sharding`)."""
        return self._state_spec is None

    @property
    def replicated(self) -> NamedSharding:
        """A copy on every device of the mesh (the session's accumulators live so)."""
        return NamedSharding(self.mesh, PartitionSpec())

    def _named(self, spec: Any, what: str) -> NamedSharding:
        if not _is_spec(spec):
            raise TypeError(f"{what} holds {spec!r}, which is not a PartitionSpec or NamedSharding; write "
                            f"jax.sharding.PartitionSpec({spec!r}) (or None for replicated).")
        if isinstance(spec, NamedSharding):
            if spec.mesh != self.mesh:
                raise ValueError(f"A NamedSharding on another mesh ({spec.mesh}) than the session's ({self.mesh}); "
                                 "give PartitionSpecs, which the session puts on its mesh.")
            return spec
        return NamedSharding(self.mesh, PartitionSpec() if spec is None else spec)

    def _expand(self, spec: Any, tree: Any, what: str) -> Any:
        """`spec` (a spec, a prefix pytree of specs, or a function of `tree`) as one
        NamedSharding per leaf of `tree`."""
        if callable(spec) and not _is_spec(spec):
            spec = spec(tree)
        if _is_spec(spec):
            return jax.tree.map(lambda _: self._named(spec, what), tree)
        try:
            return jax.tree.map(lambda s, sub: jax.tree.map(lambda _: self._named(s, what), sub), spec, tree,
                                is_leaf=_is_spec)
        except ValueError as error:
            raise ValueError(f"{what} must be a PartitionSpec, or a pytree of them shaped like the {what[:5]} "
                             f"(or a prefix of it); its structure does not match: {error}") from None

    def _kept(self, leaf: Any) -> NamedSharding:
        """The sharding a leaf came with if it is a `NamedSharding` on this mesh's
        devices (as `init_fn` placed it), else replicated."""
        sharding = getattr(leaf, "sharding", None)
        if (isinstance(sharding, NamedSharding) and sharding.mesh.axis_names == self.mesh.axis_names
                and np.array_equal(getattr(sharding.mesh, "devices", None), self.mesh.devices)):
            return sharding if sharding.mesh == self.mesh else NamedSharding(self.mesh, sharding.spec)
        return self.replicated

    def state_shardings(self, state: Any) -> Any:
        """One NamedSharding per leaf of `state` (arrays or ShapeDtypeStructs)."""
        if self._state_spec is None:
            return jax.tree.map(self._kept, state)
        return self._expand(self._state_spec, state, "state_sharding")

    def place_state(self, state: Any) -> Any:
        """`state` on its shardings. With several processes every process holds the
        whole value (built from the same seed), and each takes its devices' parts."""
        shardings = self.state_shardings(state)
        if jax.process_count() == 1:
            return jax.device_put(state, shardings)
        return jax.tree.map(_global_from_whole, state, shardings)

    def like(self, abstract: Any) -> Any:
        """The restore target: `abstract`'s shapes and dtypes with the session's shardings."""
        return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                            abstract, self.state_shardings(abstract))

    def place_batch(self, batch: Any, steps: int = 1) -> Any:
        """A global batch from this process's part of it (all of it with one process).

        Args:
          batch: one step's batch; with `steps` > 1, the batches of a multi-step run,
            stacked on a new leading axis or as a list (see `batches.as_run`).
          steps: how many steps `batch` holds. A stacked batch `(steps, batch, ...)`
            keeps its steps axis whole on every device and has each step's part sharded
            as one step's batch is: `batch_sharding` with None prepended.

        Returns:
          `batch` as global arrays on the mesh (a list stays a list).
        """
        if steps > 1 and isinstance(batch, list):
            return [self.place_batch(item) for item in batch]
        # A copy asked for: with several processes JAX's guard counts make_array_from_callback's as implicit.
        with jax.transfer_guard_host_to_device("allow"):
            if steps == 1:
                return jax.tree.map(_place_leaf, batch, self._batch_shardings(batch))
            shardings = self._batch_shardings(jax.tree.map(_one_of_stacked, batch))
            return jax.tree.map(lambda leaf, one: _place_leaf(leaf, self._with_steps_axis(one)), batch, shardings)

    def _batch_shardings(self, batch: Any) -> Any:
        """One NamedSharding per leaf of one step's `batch` (arrays or ShapeDtypeStructs)."""
        if self._batch_spec is None:
            data = NamedSharding(self.mesh, PartitionSpec(tuple(self.mesh.axis_names)))
            replicated = NamedSharding(self.mesh, PartitionSpec())
            return jax.tree.map(lambda leaf: data if np.ndim(leaf) else replicated, batch)
        return self._expand(self._batch_spec, batch, "batch_sharding")

    def _with_steps_axis(self, sharding: NamedSharding) -> NamedSharding:
        """`sharding` of one step's leaf, for the leaf stacked on a leading steps axis."""
        return NamedSharding(self.mesh, PartitionSpec(None, *sharding.spec))


def _global_from_whole(leaf: Any, sharding: NamedSharding) -> jax.Array:
    if isinstance(leaf, jax.Array) and leaf.sharding == sharding:
        return leaf
    whole = np.asarray(leaf.addressable_data(0) if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable
                       else leaf)
    return jax.make_array_from_callback(whole.shape, sharding, lambda index: whole[index])


def _one_of_stacked(leaf: Any) -> jax.ShapeDtypeStruct:
    """One step's part of a leaf stacked on a leading steps axis, as a shape and dtype."""
    dtype = getattr(leaf, "dtype", None)
    return jax.ShapeDtypeStruct(np.shape(leaf)[1:], np.result_type(leaf) if dtype is None else dtype)


def _place_leaf(leaf: Any, sharding: NamedSharding) -> jax.Array:
    if isinstance(leaf, jax.Array) and leaf.sharding == sharding:
        return leaf
    if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
        return jax.device_put(leaf, sharding)
    return jax.make_array_from_process_local_data(sharding, np.asarray(leaf))


def dispatch_ahead_default(placement: Placement | None) -> int | None:
    """The default bound on queued steps: `CPU_DISPATCH_AHEAD` with several CPU
    devices (where queued collectives can abort XLA), else none."""
    devices = placement.mesh.devices.size if placement is not None else jax.device_count()
    return CPU_DISPATCH_AHEAD if devices > 1 and jax.default_backend() == "cpu" else None


def constrain(shardings: Any) -> Callable[[Any], Any]:
    """Inside the compiled step: keep the new state on the state's shardings."""
    return lambda state: jax.lax.with_sharding_constraint(state, shardings)
