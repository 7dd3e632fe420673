"""A training run described by a config: data, model, task, optimizer, hooks, session."""

from __future__ import annotations

import difflib
import importlib
import inspect
import logging
import os
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxmon
from jaxmon._checkpoint import complete_steps, read_meta
from jaxmon._config import ConfigError
from jaxmon._data import ArrayDataSource
from jaxmon._state import TrainState
from jaxmon._training import MonitoredTrainingSession

logger = logging.getLogger("jaxmon")

#: What a run's checkpoints depend on: resuming with any of these changed is an error.
SAME_RUN = ("seed", "task", "model", "data", "optimizer.name")
_NOT_SAME_RUN = ("data.eval_split", "data.eval_batch_size")

#: The keys an experiment config may have at its top level.
TOP_LEVEL = ("seed", "steps", "data", "model", "task", "optimizer", "hooks", "session", "warm_start", "name")


def train_experiment(config: Mapping[str, Any], workdir: str | os.PathLike,
                     report: Callable[[str], None] = print) -> dict[str, Any]:
    """Trains the experiment `config` describes, in `workdir` (checkpoints, TensorBoard
    event files, `metrics.jsonl`), resuming from the latest checkpoint there.

    The config (see `configs/default.py`):
      - `seed` (int), `steps` (the last step: `StopAtStepHook(last_step=steps)`);
      - `data`: `source` (import path of `fn(split, **rest) -> {"x": ..., "y": ...}`,
        e.g. `"jaxmon.datasets:digits"`), `batch_size`, `eval_split` (default
        "test"), `eval_batch_size` (default: the whole split in one batch), and any
        other keys for `source`;
      - `model`: `name` (import path of a Flax linen module) and its arguments;
      - `task`: "classification" (softmax cross-entropy and accuracy on integer
        labels), "regression" (mean squared error), or the import path of
        `fn(predictions, batch) -> (loss, {metric: value})`;
      - `optimizer`: `name` of an optax optimizer and its arguments (a
        `learning_rate` may itself be `{"name": <optax schedule>, ...}`);
      - `hooks`: a list of `{"name": <jaxmon hook or import path>, ...arguments}`.
        `EvalHook` gets the eval function and the eval split, `ProgressBarHook` the
        number of steps, unless given;
      - `session`: arguments of `MonitoredTrainingSession` (periods of checkpoints,
        summaries and the step counter, `max_to_keep`, `warm_start`, ...).

    Args:
      config: the experiment config (see `load_config`), stored with every
        checkpoint and written to TensorBoard as text.
      workdir: the run's directory.
      report: where the lines for the person running it go (the resume notice, the
        final result).

    Returns:
      The final evaluation on the eval split: `{"step": ..., "loss": ..., <metrics>}`.
    """
    config = dict(config)
    unknown = sorted(set(config) - set(TOP_LEVEL))
    if unknown:
        raise ConfigError(_unknown_top_level(unknown[0]))
    workdir = os.fspath(workdir)
    seed = _get(config, "seed", int, 0)
    steps = _get(config, "steps", int)
    data = dict(_get(config, "data", dict))
    source = _resolve(_pop(data, "source", "data.source"), "data.source")
    batch_size = _pop(data, "batch_size", "data.batch_size")
    eval_split = data.pop("eval_split", "test")
    eval_batch_size = data.pop("eval_batch_size", None)
    train_arrays = source("train", **data)
    eval_arrays = source(eval_split, **data)
    model_config = dict(_get(config, "model", dict))
    model = _resolve(_pop(model_config, "name", "model.name"), "model.name")(**model_config)
    loss_fn = _task(config.get("task", "classification"))
    tx = _optimizer(dict(_get(config, "optimizer", dict)))

    def init_fn() -> TrainState:
        params = model.init(jax.random.PRNGKey(seed), jnp.asarray(train_arrays["x"][:1]))["params"]
        return TrainState.create(apply_fn=model.apply, params=params, tx=tx)

    def evaluate(state: TrainState, params: Any, batch: Mapping[str, Any]) -> tuple[Any, dict[str, Any]]:
        return loss_fn(state.apply_fn({"params": params}, batch["x"]), batch)

    def step_fn(state: TrainState, batch: Mapping[str, Any]):
        (loss, metrics), grads = jax.value_and_grad(lambda p: evaluate(state, p, batch), has_aux=True)(state.params)
        return state.apply_gradients(grads=grads), {"loss": loss, **metrics}

    def eval_fn(state: TrainState, batch: Mapping[str, Any]) -> dict[str, Any]:
        loss, metrics = evaluate(state, state.params, batch)
        return {"loss": loss, **metrics}

    eval_batches = _batches(eval_arrays, eval_batch_size)
    hooks, chief_only_hooks, evals = [jaxmon.StopAtStepHook(last_step=steps)], [], []
    for i, spec in enumerate(_get(config, "hooks", list, [])):
        hook, chief_only = _hook(spec, f"hooks.{i}", steps=steps, eval_fn=eval_fn, eval_batches=eval_batches,
                                 workdir=workdir)
        (chief_only_hooks if chief_only else hooks).append(hook)
        if isinstance(hook, jaxmon.EvalHook) and hook.eval_fn is eval_fn:
            evals.append(hook)
    session_args = _session_args(dict(_get(config, "session", dict, {})))
    if config.get("warm_start") is not None:
        session_args["warm_start"] = config["warm_start"]

    steps_saved = complete_steps(workdir) if os.path.isdir(workdir) else []
    if steps_saved:
        saved = (read_meta(os.path.join(workdir, str(steps_saved[-1]))) or {}).get("config")
        for change in _check_same_run(saved, config, workdir, steps_saved[-1]):
            report(f"Changed since step {steps_saved[-1]}: {change}")
    data_source = ArrayDataSource(train_arrays, batch_size, shuffle=True, seed=seed)
    try:
        session = MonitoredTrainingSession(step_fn, init_fn, data=data_source, checkpoint_dir=workdir,
                                           hooks=hooks, chief_only_hooks=chief_only_hooks, config=config,
                                           **session_args)
    except (TypeError, ValueError) as error:
        raise ConfigError(f"Creating the session from the config failed: {type(error).__name__}: {error}") from error
    if session.restored_step is not None:
        left = (f"already at the last step ({steps}): evaluating only" if session.restored_step >= steps
                else f"training on to step {steps}")
        report(f"Resumed from step {session.restored_step} in {workdir}; {left}.")
    with session:
        while not session.should_stop():
            session.run()
    if session.preemption_requested:
        report(f"Stopped by SIGTERM at step {session.step}; the checkpoint is saved: run the same command to resume.")
        return {"step": session.step, "stopped": "SIGTERM", "exit_code": 143}
    if session.state_rejected:
        report(f"Stopped early at step {session.step}: {session.state_rejected}.")
        return {"step": session.step, "stopped": session.state_rejected, "exit_code": 1}
    done = [hook.latest for hook in evals if hook.history and hook.history[-1][0] == session.step]
    if done:  # the EvalHook evaluated the final state at end: the same batches, the same function
        means = dict(done[0])
    else:
        evaluate_once = jax.jit(eval_fn)
        means = _weighted_means([(len(batch["y"]), evaluate_once(session.state, batch)) for batch in eval_batches])
    result = {"step": session.step, **means}
    shown = ", ".join(f"{name} {value:.4f}" for name, value in means.items())
    report(f"step {session.step}: {eval_split} {shown}  ({workdir})")
    return result


def _weighted_means(results: list[tuple[int, Mapping[str, Any]]]) -> dict[str, float]:
    total = sum(n for n, _ in results)
    names = list(results[0][1])
    return {name: float(sum(n * np.asarray(values[name], np.float64) for n, values in results) / total)
            for name in names}


def _batches(arrays: Mapping[str, np.ndarray], batch_size: int | None) -> list[dict[str, np.ndarray]]:
    n = len(next(iter(arrays.values())))
    size = n if batch_size is None else batch_size
    return [{k: np.asarray(v[i:i + size]) for k, v in arrays.items()} for i in range(0, n, size)]


def _task(task: Any) -> Callable[[Any, Mapping[str, Any]], tuple[Any, dict[str, Any]]]:
    if task == "classification":
        def classification(logits, batch):
            loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
            return loss, {"accuracy": jnp.mean(jnp.argmax(logits, -1) == batch["y"])}
        return classification
    if task == "regression":
        def regression(predictions, batch):
            return jnp.mean((predictions - batch["y"]) ** 2), {}
        return regression
    if isinstance(task, str) and (":" in task or "." in task):
        return _resolve(task, "task")
    raise ConfigError(f"task must be 'classification', 'regression' or the import path of "
                      f"fn(predictions, batch) -> (loss, metrics) (e.g. 'mypkg.tasks:loss'); got {task!r}.")


def _optimizer(spec: dict[str, Any]) -> optax.GradientTransformation:
    name = _pop(spec, "name", "optimizer.name")
    if isinstance(spec.get("learning_rate"), Mapping):
        schedule = dict(spec["learning_rate"])
        schedule_name = _pop(schedule, "name", "optimizer.learning_rate.name")
        spec["learning_rate"] = _optax(schedule_name, "optimizer.learning_rate.name")(**schedule)
    try:
        return _optax(name, "optimizer.name")(**spec)
    except TypeError as error:
        raise ConfigError(f"optimizer {name!r}: {error}. Its arguments come from the keys of optimizer "
                          "other than name.") from error


def _optax(name: str, key: str) -> Callable[..., Any]:
    fn = getattr(optax, name, None) if isinstance(name, str) else None
    if not callable(fn):
        public = [n for n in dir(optax) if not n.startswith("_")]
        near = difflib.get_close_matches(str(name), public, n=1)
        raise ConfigError(f"{key}={name!r} is not an optax function." + (f" Did you mean {near[0]!r}?" if near else ""))
    return fn


def _hook(spec: Any, key: str, *, steps: int, eval_fn: Callable, eval_batches: list, workdir: str) -> Any:
    if not isinstance(spec, Mapping) or "name" not in spec:
        raise ConfigError(f"{key} must be a dict with a name, e.g. {{'name': 'EvalHook', 'every_n_steps': 500}}; "
                          f"got {spec!r}.")
    args = dict(spec)
    name = args.pop("name")
    chief_only = args.pop("chief_only", name == "ProgressBarHook")
    if not isinstance(chief_only, bool):
        raise ConfigError(f"{key}.chief_only must be True or False; got {chief_only!r}.")
    if isinstance(name, str) and name.isidentifier():
        cls = getattr(jaxmon, name, None)
        if not (isinstance(cls, type) and issubclass(cls, jaxmon.Hook)):
            hooks = sorted(n for n in dir(jaxmon) if n.endswith("Hook") and n[0].isupper())
            near = difflib.get_close_matches(name, hooks, n=1)
            raise ConfigError(f"{key}.name={name!r} is not a jaxmon hook." + (f" Did you mean {near[0]!r}?" if near
                              else "") + f" jaxmon's hooks: {', '.join(hooks)}; or give an import path 'pkg.mod:Hook'.")
    else:
        cls = _resolve(name, f"{key}.name")
    if cls is jaxmon.EvalHook:
        args.setdefault("eval_fn", eval_fn)
        args.setdefault("data", eval_batches)
        if "summary_writer" not in args and jax.process_index() == 0:  # one process writes event files
            args.setdefault("output_dir", workdir)
    elif cls is jaxmon.ProgressBarHook:
        args.setdefault("total_steps", steps)
    try:
        return cls(**args), chief_only
    except (TypeError, ValueError) as error:
        raise ConfigError(f"{key} ({name}): {error}") from error


def _session_args(args: dict[str, Any]) -> dict[str, Any]:
    """The `session` section, checked against what `MonitoredTrainingSession` takes."""
    known = {name for cls in (MonitoredTrainingSession, jaxmon.MonitoredSession)
             for name in inspect.signature(cls.__init__).parameters if name not in ("self", "kwargs")}
    reserved = {"step_fn", "init_fn", "state", "data", "checkpoint_dir", "hooks", "chief_only_hooks", "config"}
    for name in args:
        if name in reserved:
            raise ConfigError(f"session.{name} is set by the experiment itself; remove it from the config.")
        if name not in known:
            near = difflib.get_close_matches(name, sorted(known - reserved), n=1)
            raise ConfigError(f"session.{name} is not an argument of MonitoredTrainingSession."
                              + (f" Did you mean session.{near[0]}?" if near else "")
                              + f" It takes: {', '.join(sorted(known - reserved))}.")
    return args


def _check_same_run(saved: Any, config: Mapping[str, Any], workdir: str, step: int) -> list[str]:
    """Raises a `ConfigError` if `config` changes what the checkpoints in `workdir`
    depend on (`SAME_RUN`); returns the other changes, one line each."""
    if not isinstance(saved, Mapping):
        return []
    changes = _diff(saved, config, "")
    breaking = [change for change in changes if _checkpoints_depend_on(change.split(":")[0])]
    if breaking:
        raise ConfigError(
            f"{workdir} holds checkpoints (latest step {step}) of a run whose config differs where the "
            f"checkpoints depend on it: {'; '.join(breaking)}. Resume with the same settings, use a new "
            f"--workdir, or warm-start a new run from this one (--config.warm_start={workdir}).")
    return changes


def _checkpoints_depend_on(key: str) -> bool:
    return not key.startswith(_NOT_SAME_RUN) and any(key == k or key.startswith(k + ".") for k in SAME_RUN)


def _diff(old: Any, new: Any, key: str) -> list[str]:
    if isinstance(old, Mapping) and isinstance(new, Mapping):
        return [change for name in sorted(set(old) | set(new), key=str)
                for change in _diff(old.get(name, "<absent>"), new.get(name, "<absent>"),
                                    f"{key}.{name}" if key else str(name))]
    if isinstance(old, list) and isinstance(new, list) and len(old) == len(new):
        return [change for i, (a, b) in enumerate(zip(old, new, strict=True)) for change in _diff(a, b, f"{key}.{i}")]
    return [] if old == new else [f"{key}: {old!r} -> {new!r}"]


def _resolve(path: Any, key: str) -> Any:
    """The object at an import path: "pkg.mod:attr" or "pkg.mod.attr"."""
    if not isinstance(path, str) or not path:
        raise ConfigError(f"{key} must be an import path such as 'jaxmon.models:MLP'; got {path!r}.")
    module_name, _, attr = path.partition(":") if ":" in path else path.rpartition(".")
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise ConfigError(f"{key}={path!r}: cannot import {module_name!r} ({error}).") from error
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            public = [n for n in dir(obj) if not n.startswith("_")]
            near = difflib.get_close_matches(part, public, n=1)
            raise ConfigError(f"{key}={path!r}: {module_name} has no {attr!r}."
                              + (f" Did you mean {module_name}:{near[0]}?" if near else ""))
        obj = getattr(obj, part)
    return obj


_MISSING = object()


def _get(config: Mapping[str, Any], key: str, kind: type, default: Any = _MISSING) -> Any:
    if key not in config:
        if default is _MISSING:
            raise ConfigError(f"The experiment config needs {key!r} (a {kind.__name__}); see configs/default.py.")
        return default
    value = config[key]
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ConfigError(f"Config key {key!r} must be a {kind.__name__}; got {value!r}.")
    return value


def _pop(section: dict[str, Any], name: str, key: str) -> Any:
    if name not in section:
        raise ConfigError(f"The experiment config needs {key!r}; see configs/default.py.")
    return section.pop(name)


def _unknown_top_level(key: str) -> str:
    near = difflib.get_close_matches(key, TOP_LEVEL, n=1)
    return (f"Unknown config key {key!r}." + (f" Did you mean {near[0]!r}?" if near else "")
            + f" An experiment config has: {', '.join(TOP_LEVEL)}.")
