"""Abstract values (`jax.ShapeDtypeStruct`s) of trees and of a run's batches: what a
program is lowered, traced or counted with, before any value exists."""

from __future__ import annotations

from typing import Any

import jax


def abstract(tree: Any) -> Any:
    """`tree`'s leaves as `jax.ShapeDtypeStruct`s that lower to the program a call with
    them compiles (a committed array's sharding; weak types kept)."""
    def leaf(x):
        aval = jax.typeof(x)
        sharding = x.sharding if isinstance(x, jax.Array) and x.committed else None
        return jax.ShapeDtypeStruct(aval.shape, aval.dtype, sharding=sharding, weak_type=aval.weak_type)

    return jax.tree.map(leaf, tree)


def one_step(batch: Any, length: int) -> Any:
    """The abstract batch of one step of a run of `length` steps given `batch` (as
    `as_run` makes it: one batch, a list of batches on the device, or a stacked one)."""
    if length == 1:
        return abstract(batch)
    if isinstance(batch, list):
        return abstract(batch[0])
    return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape[1:], s.dtype, sharding=_steps_axis(s.sharding, -1)),
                        abstract(batch))


def abstract_run(one: Any, steps: int) -> Any:
    """The abstract batch of a run of `steps` steps stacked, from one step's `one` (as
    `one_step` gives it): a sharding on a mesh keeps the steps axis whole."""
    return jax.tree.map(lambda s: jax.ShapeDtypeStruct((steps, *s.shape), s.dtype,
                                                       sharding=_steps_axis(s.sharding, +1)), one)


def _steps_axis(sharding: Any, change: int) -> Any:
    """`sharding` for a leaf with a leading steps axis added (+1) or taken away (-1)."""
    if not isinstance(sharding, jax.sharding.NamedSharding):
        return sharding  # None, or one device's, whatever the rank
    spec = (None, *sharding.spec) if change > 0 else tuple(sharding.spec)[1:]
    return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(*spec))
