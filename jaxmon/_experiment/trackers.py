"""The `writers` section: the experiment trackers a run writes to besides TensorBoard and
metrics.jsonl, built and checked without JAX (the command line checks them before JAX
loads: a missing package or an unusable tracking URI is said at once)."""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

from jaxmon._base.errors import ConfigError
from jaxmon._experiment.keys import pop_key
from jaxmon._writers.mlflow_runs import MlflowWriter
from jaxmon._writers.wandb_runs import WandbWriter

#: The trackers by the name a config gives them.
TRACKERS = {"mlflow": MlflowWriter, "wandb": WandbWriter}


def writers_of(specs: Any, workdir: str) -> list[Any]:
    """The `writers` section: experiment trackers that get what the run writes to
    TensorBoard and metrics.jsonl, `[{"name": "mlflow", "tracking_uri": ..., "experiment":
    ...}]` (`jm.MlflowWriter`'s arguments) or `{"name": "wandb", "project": ...}`
    (`jm.WandbWriter`'s); the chief's only. Each is checked here (its package installed,
    its tracking URI usable), so that a bad one ends the command before anything runs."""
    if specs is None:
        return []
    if not isinstance(specs, list) or not all(isinstance(spec, Mapping) for spec in specs):
        raise ConfigError(f"writers must be a list of dicts with a name, e.g. [{{'name': 'mlflow', 'experiment': "
                          f"'lm'}}]; got {specs!r:.100}.")
    writers = []
    for i, spec in enumerate(specs):
        spec = dict(spec)
        name = pop_key(spec, "name", f"writers.{i}.name")
        kind = TRACKERS.get(name)
        if kind is None:
            raise ConfigError(f"writers.{i}.name={name!r}: the writers are 'mlflow' (jm.MlflowWriter) and 'wandb' "
                              "(jm.WandbWriter).")
        try:
            writer = kind(workdir, **spec)
        except TypeError as error:
            takes = ", ".join(list(inspect.signature(kind).parameters)[1:])
            raise ConfigError(f"writers.{i}: {error}; jm.{kind.__name__} takes {takes}.") from error
        try:
            writer.check()
        except ConfigError as error:
            raise ConfigError(f"writers.{i} ({name}): {error}") from None
        writers.append(writer)
    return writers
