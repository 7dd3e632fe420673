"""Warm start: a fresh state takes the leaves of a checkpoint whose path, shape and
dtype match (TF's `warm_start_from`), and a report says which it took."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any, NamedTuple

import jax

from jaxmon._base.paths import path_name
from jaxmon._checkpoints.manager import restore_checkpoint

logger = logging.getLogger("jaxmon")


class WarmStartReport(NamedTuple):
    """What a warm start took from its checkpoint, by leaf path ("params/Dense_0/kernel")."""

    source: str
    restored: list[str]
    fresh: list[str]  # not in the checkpoint: left as init_fn made them
    mismatched: list[str]  # in the checkpoint with another shape or dtype: left fresh
    unused: list[str]  # in the checkpoint, not in the state
    skipped: tuple[str, ...] = ()  # training bookkeeping (optimizer state, step, rng): never warm-started


#: In a state with `params` at its top level (a TrainState), these parts are training
#: bookkeeping, which a warm start leaves fresh: TF's warm start took the model's
#: variables, not the optimizer's slots or the global step.
BOOKKEEPING = ("opt_state", "step", "rng")


def warm_start(state: Any, source: str | os.PathLike | Callable[[Any], Any]) -> tuple[Any, WarmStartReport | None]:
    """Applies `warm_start` to a freshly initialised state (see `MonitoredSession`)."""
    if callable(source):
        return source(state), None
    saved = restore_checkpoint(source).state
    by_path = {path_name(path): value for path, value in jax.tree_util.tree_flatten_with_path(saved)[0]}
    restored, fresh, mismatched, skipped, leaves = [], [], [], [], []
    paths, tree = jax.tree_util.tree_flatten_with_path(state)
    model_only = any(path_name(path[:1]) == "params" for path, _ in paths)
    for path, leaf in paths:
        name = path_name(path)
        value = by_path.pop(name, None)
        if model_only and path_name(path[:1]) in BOOKKEEPING:
            skipped.append(name)
            value = None
        elif value is None:
            fresh.append(name)
        elif value.shape != leaf.shape or value.dtype != leaf.dtype:
            mismatched.append(f"{name} (checkpoint {value.dtype}{list(value.shape)}, state {leaf.dtype}"
                              f"{list(leaf.shape)})")
            value = None
        else:
            restored.append(name)
            value = jax.device_put(value, getattr(leaf, "sharding", None))
        leaves.append(leaf if value is None else value)
    report = WarmStartReport(os.fspath(source), restored, fresh, mismatched, sorted(by_path), tuple(skipped))
    logger.info("Warm start from %s: restored %d leaves %s; left fresh %s; shape or dtype differs %s; "
                "not in the state %s; optimizer state, step and rng left fresh %s.", report.source,
                len(restored), restored, fresh, mismatched, report.unused, skipped)
    return jax.tree.unflatten(tree, leaves), report
