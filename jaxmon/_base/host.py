"""Device values read on the host: the one read of a run (`to_host`)."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

#: Up to this many leaves are read one by one (`np.asarray`): two scalars take 2.3 µs of
#: the host so, 14.7 µs through `jax.device_get` (CPU, jax 0.10), which pays for more.
_READ_ONE_BY_ONE = 4


def to_host(values: Any) -> Any:
    """`jax.device_get`, with a fast path for the common few single arrays. An array
    spread over several processes must be replicated (a loss, a metric): each process
    then reads its own copy."""
    leaves, tree = jax.tree.flatten(values)
    if any(isinstance(leaf, jax.Array) and not leaf.is_fully_addressable for leaf in leaves):
        return tree.unflatten([_local_copy(leaf) if isinstance(leaf, jax.Array) else leaf for leaf in leaves])
    if len(leaves) > _READ_ONE_BY_ONE:
        return jax.device_get(values)
    return tree.unflatten([np.asarray(leaf) if isinstance(leaf, jax.Array) else leaf for leaf in leaves])


def _local_copy(array: jax.Array) -> np.ndarray:
    if array.is_fully_addressable:
        return np.asarray(array)
    if not array.is_fully_replicated:
        raise ValueError(
            f"A fetched value of shape {array.shape} is sharded across processes ({array.sharding}); every "
            "process reads fetches on the host, so fetch values replicated on every device: a mean or a "
            "sum (a loss, a metric), or jax.lax.with_sharding_constraint(x, jax.sharding.PartitionSpec()) "
            "in a fetch function.")
    return np.asarray(array.addressable_data(0))
