"""The parts of a run a config describes, before any hook or session: the data, the
model, the optimizer, the task, the mesh and where the state lives on it."""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import jax
import numpy as np
import optax

from jaxmon._base.errors import ConfigError
from jaxmon._data import loaders as _loaders
from jaxmon._data.arrays import ArrayDataSource
from jaxmon._experiment import tasks
from jaxmon._experiment.keys import get_key, pop_key, resolve
from jaxmon._experiment.mesh import Layout, layout_of, mesh_of
from jaxmon._experiment.sections import optimizer_of


@dataclasses.dataclass(frozen=True)
class Parts:
    """What a config builds before the session: its `seed` and last step, the mesh
    (None: one device), the loaded data, the task, the `init_fn` the session gets (the
    task's, jitted onto its shardings with a mesh), the layout, and the eval batches."""

    seed: int
    steps: int
    mesh: jax.sharding.Mesh | None
    data: Data
    context: tasks.TaskContext
    task: tasks.Task
    init_fn: Callable[[], Any]
    layout: Layout | None
    eval_batches: list[dict[str, np.ndarray]]


def parts_of(config: Mapping[str, Any]) -> Parts:
    """Builds the parts of `config` (checked: a `ConfigError` names what is wrong; a
    `ShardingError` the parameter and mesh axis that do not divide)."""
    seed = get_key(config, "seed", int, 0)
    if not 0 <= seed <= _MAX_SEED:
        raise ConfigError(f"Config key 'seed' must be an int from 0 to 2**63 - 1 ({_MAX_SEED}); got {seed}. "
                          "Pass e.g. --config.seed=0.")
    steps = get_key(config, "steps", int)
    if steps < 1:
        raise ConfigError(f"Config key 'steps' is the last step to train to, at least 1; got {steps}. Pass e.g. "
                          "--config.steps=100.")
    mesh = mesh_of(config.get("mesh"))
    data = load_data(config)
    task_name = config.get("task", "classification")
    context = tasks.TaskContext(config, _model(config), _optimizer(config), seed,
                                dict(data.example), mesh)
    task = tasks.task_of(task_name)(context)
    task_init = init_fn = _naming_the_model(task.init_fn, config)
    layout = None
    if mesh is not None:
        with _initialising(config):  # the layout reads the model's parameter shapes
            layout = layout_of(config, mesh, context, task_init, built_in=tasks.is_built_in(task_name))
            layout.check(jax.eval_shape(task_init), data.batch_size)
        if tasks.is_built_in(task_name) or config.get("sharding"):
            init_fn = layout.sharded_init(task_init)
    return Parts(seed, steps, mesh, data, context, task, init_fn, layout,
                 batches(data.evaluation, data.eval_batch_size))


#: The largest seed every user of it takes (JAX's PRNG key, NumPy's and grain's shuffles).
_MAX_SEED = 2**63 - 1


def _naming_the_model(init_fn: Callable[[], Any], config: Mapping[str, Any]) -> Callable[[], Any]:
    """`init_fn`, whose TypeError or ValueError (a model built from values it cannot
    take) becomes a `ConfigError` naming the `model` section's keys and values."""

    def init() -> Any:
        with _initialising(config):
            return init_fn()

    return init


@contextlib.contextmanager
def _initialising(config: Mapping[str, Any]) -> Iterator[None]:
    try:
        yield
    except ConfigError:
        raise
    except (TypeError, ValueError, OverflowError) as error:
        raise ConfigError(_init_failed(config, error)) from error


def _init_failed(config: Mapping[str, Any], error: BaseException) -> str:
    """One line for a failed initialisation: the error, and the `model` section's
    values, those holding a negative number (a size, usually) first."""
    text = " ".join(f"{type(error).__name__}: {error}".split()).rstrip(".")
    model = config.get("model")
    if not isinstance(model, Mapping):
        return (f"Initialising the state of task {config.get('task', 'classification')!r} failed: {text}. Check "
                "the config values its init_fn uses.")
    values = {f"model.{key}": value for key, value in model.items() if key != "name"}
    suspects = [key for key, value in values.items() if _negative(value)]
    listed = ", ".join(f"{key}={value!r}" for key, value in values.items())
    if suspects:
        named = ", ".join(f"{key}={values[key]!r}" for key in suspects)
        return (f"Initialising the model {model.get('name')!r} failed: {text}. The likely cause: {named} (a "
                f"negative number; sizes are >= 1). Fix the model section ({listed}).")
    return f"Initialising the model {model.get('name')!r} ({listed}) failed: {text}. Check those values."


def _negative(value: Any) -> bool:
    if isinstance(value, (list, tuple)):
        return any(_negative(item) for item in value)
    return isinstance(value, int) and not isinstance(value, bool) and value < 0


@dataclasses.dataclass(frozen=True)
class Data:
    """The `data` section, loaded: the train and eval splits and how to batch them. The
    train split is arrays (batched here), or the batches `data.source` gives itself (an
    iterator, resumed exactly when it has `get_state`/`set_state`); `example` holds the
    first two rows of either."""

    train: Mapping[str, Any] | Iterator[Any]
    evaluation: Mapping[str, Any]
    batch_size: Any
    eval_split: Any
    eval_batch_size: int | None
    loader: str
    worker_count: int
    example: Mapping[str, np.ndarray]


def load_data(config: Mapping[str, Any]) -> Data:
    """Calls the `data.source` function for the train and eval splits."""
    data = dict(get_key(config, "data", dict))
    source = resolve(pop_key(data, "source", "data.source"), "data.source")
    batch_size = pop_key(data, "batch_size", "data.batch_size")
    eval_split = data.pop("eval_split", "test")
    eval_batch_size = data.pop("eval_batch_size", None)
    loader, worker_count = data.pop("loader", "arrays"), data.pop("worker_count", 2)
    data.pop("pad_id", None)  # the task's (`tasks.pad_id`), not the source's
    if loader not in ("arrays", "grain"):
        raise ConfigError(f"data.loader={loader!r}: give 'arrays' (jm.ArrayDataSource) or 'grain'.")
    if not isinstance(worker_count, int) or isinstance(worker_count, bool) or worker_count < 0:
        raise ConfigError(f"data.worker_count={worker_count!r}: give a number of grain worker processes >= 0.")
    train, first = _train_split(source("train", **data))
    return Data(train, source(eval_split, **data), batch_size, eval_split, eval_batch_size, loader, worker_count,
                {key: np.asarray(value[:2]) for key, value in first.items()})


def _train_split(train: Any) -> tuple[Any, Mapping[str, Any]]:
    """The train split as `data.source` gave it, and its first rows' source: the arrays, or
    the first batch of an iterator of batches (taken back: its position set back, or the
    batch put in front again)."""
    if isinstance(train, Mapping):
        return train, train
    if not isinstance(train, Iterable):
        raise ConfigError(f"data.source gave {type(train).__name__} for the train split; give arrays {{'x': ..., "
                          "'y': ...}, or an iterator of such batches.")
    train = iter(train)
    resumable = callable(getattr(train, "get_state", None)) and callable(getattr(train, "set_state", None))
    position = train.get_state() if resumable else None
    first = next(train, None)
    if not isinstance(first, Mapping):
        raise ConfigError(f"data.source's train batches must be dicts of arrays; its first is {first!r:.80}.")
    if resumable:
        train.set_state(position)
        return train, first
    return itertools.chain([first], train), first


def train_data(data: Data, seed: int) -> Any:
    """The training batches, reshuffled each epoch, resumable exactly. With several
    processes each reads its own part of every global batch; the position counts global
    batches, so a resume on another number of processes sees the same global batches."""
    if not isinstance(data.train, Mapping):  # the source's own batches, each process's as it gives them
        return data.train
    count = jax.process_count()
    if data.batch_size % count:
        raise ConfigError(f"data.batch_size={data.batch_size} does not divide among {count} JAX processes (each "
                          f"feeds its part of every batch); give a multiple of {count}.")
    if data.loader == "grain":
        arrays = {key: np.asarray(value) for key, value in data.train.items()}
        return _loaders.array_pipeline(arrays, data.batch_size, seed=seed, worker_count=data.worker_count,
                                       shard=(jax.process_index(), count))
    return ArrayDataSource(data.train, data.batch_size // count, shuffle=True, seed=seed, shard="process")


def _model(config: Mapping[str, Any]) -> Any:
    """The Flax module `model.name` names, made with the other keys of `model`; None without `model`."""
    if config.get("model") is None:
        return None
    model_config = dict(get_key(config, "model", dict))
    return resolve(pop_key(model_config, "name", "model.name"), "model.name")(**model_config)


def _optimizer(config: Mapping[str, Any]) -> optax.GradientTransformation | None:
    if config.get("optimizer") is None:
        return None
    return optimizer_of(dict(get_key(config, "optimizer", dict)))


def batches(arrays: Mapping[str, np.ndarray], batch_size: int | None) -> list[dict[str, np.ndarray]]:
    n = len(next(iter(arrays.values())))
    size = n if batch_size is None else batch_size
    return [{k: np.asarray(v[i:i + size]) for k, v in arrays.items()} for i in range(0, n, size)]
