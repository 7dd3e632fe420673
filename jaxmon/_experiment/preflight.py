"""`jaxmon check`: what a config will train, before it trains: the resolved config, the
parameters per top-level module, the mesh, where each parameter lives, the batch, and the
compiled step's memory per device and compile time."""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxmon._experiment.keys import check_top_level
from jaxmon._experiment.parts import Parts, parts_of

__all__ = ["check_experiment"]


def check_experiment(config: Mapping[str, Any]) -> dict[str, Any]:
    """Builds everything `config` describes but trains nothing: compiles one step on
    the run's devices and returns the report `jaxmon check` prints (JSON-able).

    Raises:
      ConfigError: as `jaxmon train` would, before anything ran (a `ShardingError`
        names the parameter, its shape and the mesh axis that does not divide it).
    """
    config = dict(config)
    check_top_level(config)
    parts = parts_of(config)
    abstract = jax.eval_shape(parts.init_fn)
    rows = _rows(parts, abstract)
    params = getattr(abstract, "params", abstract)
    batch = {key: jax.ShapeDtypeStruct((parts.data.batch_size, *np.shape(value)[1:]), np.asarray(value).dtype)
             for key, value in parts.data.train.items()}
    compile_secs, memory = _compile(parts, abstract, batch)
    return {
        "config": config,
        "parameters": _per_module(params),
        "mesh": None if parts.mesh is None else dict(parts.mesh.shape),
        "devices": [str(device) for device in jax.devices()[:8]] + ([f"... {jax.device_count()} in all"]
                                                                     if jax.device_count() > 8 else []),
        "state": [{"path": path, "shape": list(shape), "dtype": dtype, "sharding": spec}
                  for path, shape, dtype, spec in rows],
        "batch": {key: {"shape": list(value.shape), "dtype": str(value.dtype),
                        "sharding": None if parts.layout is None else str(parts.layout.batch_sharding)}
                  for key, value in batch.items()},
        "compile_secs": round(compile_secs, 3),
        "memory_per_device": memory,
    }


def _rows(parts: Parts, abstract: Any) -> list[tuple[str, tuple[int, ...], str, str]]:
    """(path, shape, dtype, sharding) of every leaf of the state."""
    rows = []
    for path, leaf in jax.tree_util.tree_leaves_with_path(abstract):
        sharding = getattr(leaf, "sharding", None)
        spec = sharding.spec if isinstance(sharding, NamedSharding) else P()
        rows.append(("state" + jax.tree_util.keystr(path), tuple(np.shape(leaf)), str(leaf.dtype),
                     "one device" if parts.mesh is None else "replicated" if not any(spec) else str(spec)))
    return rows


def _per_module(params: Any) -> dict[str, int]:
    """The number of parameters under each top-level key (all of them as "total")."""
    counts: dict[str, int] = {}
    if isinstance(params, Mapping):
        for name, sub in params.items():
            counts[str(name)] = sum(math.prod(np.shape(leaf)) for leaf in jax.tree.leaves(sub))
    counts["total"] = sum(math.prod(np.shape(leaf)) for leaf in jax.tree.leaves(params))
    return counts


def _compile(parts: Parts, abstract: Any, batch: Mapping[str, jax.ShapeDtypeStruct]) -> tuple[float, dict[str, int]]:
    """Compiles one training step on the state's and batch's shardings: the seconds it
    took, and the compiled program's memory per device (XLA's `memory_analysis`)."""
    if parts.layout is not None:
        sharding = NamedSharding(parts.mesh, parts.layout.batch_sharding)
        batch = {key: jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=sharding) for key, value in batch.items()}
    start = time.perf_counter()
    compiled = jax.jit(parts.task.step_fn, donate_argnums=0).lower(abstract, batch).compile()
    seconds = time.perf_counter() - start
    analysis = compiled.memory_analysis()
    fields = ("argument_size_in_bytes", "output_size_in_bytes", "temp_size_in_bytes", "alias_size_in_bytes",
              "generated_code_size_in_bytes")
    return seconds, {name.removesuffix("_size_in_bytes"): int(getattr(analysis, name, 0) or 0) for name in fields}
