"""`jaxmon check`: what a config will train, before it trains: the resolved config, the
parameters per top-level module, the mesh, where each parameter lives, the batch, and
each program's compile time and memory per device (the step for runs of one step and of
`steps_per_dispatch` steps, the evaluation)."""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxmon._experiment.keys import check_keys
from jaxmon._experiment.parts import Parts, parts_of
from jaxmon._experiment.sections import session_args_of
from jaxmon._experiment.trackers import writers_of

__all__ = ["check_experiment"]


def check_experiment(config: Mapping[str, Any]) -> dict[str, Any]:
    """Builds everything `config` describes but trains nothing: compiles one step on
    the run's devices and returns the report `jaxmon check` prints (JSON-able).

    Raises:
      ConfigError: as `jaxmon train` would, before anything ran (a `ShardingError`
        names the parameter, its shape and the mesh axis that does not divide it).
    """
    config = dict(config)
    check_keys(config)
    writers_of(config.get("writers"), "")  # a tracker's missing package or unusable URI, as train says it
    parts = parts_of(config)
    abstract = jax.eval_shape(parts.init_fn)
    rows = _rows(parts, abstract)
    params = getattr(abstract, "params", abstract)
    batch = {key: jax.ShapeDtypeStruct((parts.data.batch_size, *np.shape(value)[1:]), np.asarray(value).dtype)
             for key, value in parts.data.example.items()}
    steps_per_dispatch = session_args_of(config).get("steps_per_dispatch", 1)
    programs = _programs(parts, abstract, batch, steps_per_dispatch if isinstance(steps_per_dispatch, int) else 1)
    compile_secs, memory = programs[0]["compile_secs"], programs[0]["memory_per_device"]
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
        "compile_secs": compile_secs,
        "memory_per_device": memory,
        "programs": programs,
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


def _programs(parts: Parts, abstract: Any, batch: Mapping[str, jax.ShapeDtypeStruct],
              steps_per_dispatch: int) -> list[dict[str, Any]]:
    """Compiles what a run compiles most of its time on: the step for runs of one step,
    for runs of `steps_per_dispatch` steps (scanned), and the evaluation on one eval
    batch; each one's name, compile seconds and memory per device (XLA's
    `memory_analysis`). The session's own programs add its accumulators (a few numbers
    per hook) and the runs of other lengths its schedules need."""
    placed = _placed(parts, batch)
    programs = [_compiled("step, runs of 1 step", jax.jit(parts.task.step_fn, donate_argnums=0), abstract, placed)]
    if steps_per_dispatch > 1:
        def scanned(state, batches):
            state, outputs = jax.lax.scan(parts.task.step_fn, state, batches)
            return state, jax.tree.map(lambda x: x[-1], outputs)

        stacked = _placed(parts, {key: jax.ShapeDtypeStruct((steps_per_dispatch, *value.shape), value.dtype)
                                  for key, value in batch.items()}, stacked=True)
        programs.append(_compiled(f"step, runs of {steps_per_dispatch} steps", jax.jit(scanned, donate_argnums=0),
                                  abstract, stacked))
    if parts.eval_batches:
        example = parts.eval_batches[0]  # given as it is (host arrays), as `EvalHook` gives it
        eval_batch = {key: jax.ShapeDtypeStruct(np.shape(value), np.asarray(value).dtype)
                      for key, value in example.items()}
        programs.append(_compiled("evaluation, one batch", jax.jit(parts.task.eval_fn), abstract, eval_batch))
    return programs


def _placed(parts: Parts, batch: Mapping[str, jax.ShapeDtypeStruct], stacked: bool = False) -> dict[str, Any]:
    """`batch` on the run's batch sharding (`stacked`: behind a leading steps axis)."""
    if parts.layout is None:
        return dict(batch)
    spec = P(None, *parts.layout.batch_sharding) if stacked else parts.layout.batch_sharding
    sharding = NamedSharding(parts.mesh, spec)
    return {key: jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=sharding) for key, value in batch.items()}


def _compiled(name: str, fn: Any, *args: Any) -> dict[str, Any]:
    """Compiles `fn` for `args`: its name, the seconds it took and its memory per device."""
    start = time.perf_counter()
    compiled = fn.lower(*args).compile()
    seconds = time.perf_counter() - start
    analysis = compiled.memory_analysis()
    fields = ("argument_size_in_bytes", "output_size_in_bytes", "temp_size_in_bytes", "alias_size_in_bytes",
              "generated_code_size_in_bytes")
    return {"name": name, "compile_secs": round(seconds, 3),
            "memory_per_device": {field.removesuffix("_size_in_bytes"): int(getattr(analysis, field, 0) or 0)
                                  for field in fields}}
