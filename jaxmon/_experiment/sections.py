"""The sections of an experiment config, built: the optimizer, the hooks, the `perf`
section's throughput hook, and the session's arguments."""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np
import optax

import jaxmon
from jaxmon._base.errors import ConfigError
from jaxmon._experiment.keys import FLAG, INT, NUMBER, TEXT, Kind, check_kind, get_key, pop_key, resolve
from jaxmon._run.training import MonitoredTrainingSession
from jaxmon.hooks._throughput import FIGURES, Throughput, check_figures
from jaxmon.models import Transformer, transformer_flops_per_token

#: The `MonitoredTrainingSession` arguments the experiment sets itself.
_RESERVED = {"step_fn", "init_fn", "state", "data", "checkpoint_dir", "hooks", "chief_only_hooks", "config",
             "mesh", "state_sharding", "batch_sharding"}

#: The `perf` section's figures: `Throughput`'s (and `MonitoredTrainingSession`'s) arguments.
PERF_FIGURES = ("peak_tflops", "flops_per_step", "examples_per_step", "tokens_per_step")


def optimizer_of(spec: dict[str, Any]) -> optax.GradientTransformation:
    """The optax optimizer of the `optimizer` section (a copy: `spec` is changed).

    Args:
      spec: `name` of an optax optimizer and its arguments; a `learning_rate` may be
        `{"name": <optax schedule>, ...}` (e.g. "warmup_cosine_decay_schedule");
        `clip_global_norm`: clip the gradients to this global norm first;
        `accumulate_steps`: the task's (`tasks.accumulate_steps`): each step's batch is
        split into that many micro-batches whose mean gradient makes the one update;
        `weight_decay_mask`: which parameters an optimizer with weight decay (adamw,
        lion, lamb, adafactor, ...) decays: "matrices" (the default: those of 2 or more
        dimensions, not biases and norm scales, as nanoGPT, MaxText and Levanter do; see
        `matrices`),
        "all", or the import path of a function of the parameters that gives a tree of
        bools (optax's `mask`).

    Raises:
      ConfigError: a name is not an optax function, or the arguments do not fit it.
    """
    name = pop_key(spec, "name", "optimizer.name")
    clip, decay_mask = spec.pop("clip_global_norm", None), spec.pop("weight_decay_mask", None)
    spec.pop("accumulate_steps", None)  # the task's: micro-batches of one step (`tasks.accumulate_steps`)
    if clip is not None and (not isinstance(clip, (int, float)) or isinstance(clip, bool) or clip <= 0):
        raise ConfigError(f"optimizer.clip_global_norm={clip!r}: give a norm > 0, or None for no clipping.")
    tx = _optimizer(name, spec, decay_mask)
    if clip is not None:
        tx = optax.chain(optax.clip_by_global_norm(float(clip)), tx)
    return tx


def learning_rate_of(spec: Mapping[str, Any] | None) -> Callable[[Any], Any] | None:
    """The `optimizer` section's learning rate as a function of the number of updates
    made (its schedule, or its constant), or None when the section gives none."""
    rate = None if spec is None else spec.get("learning_rate")
    if isinstance(rate, Mapping):
        return _schedule(dict(rate))
    if isinstance(rate, (int, float)) and not isinstance(rate, bool):
        return lambda count: jax.numpy.asarray(rate, jax.numpy.float32)
    return None


def _optimizer(name: Any, spec: dict[str, Any], decay_mask: Any) -> optax.GradientTransformation:
    if isinstance(spec.get("learning_rate"), Mapping):
        spec["learning_rate"] = _schedule(dict(spec["learning_rate"]))
    make = _optax(name, "optimizer.name")
    mask_arg = next((arg for arg in _MASK_ARGS if arg in inspect.signature(make).parameters), None)
    if mask_arg is None and decay_mask is not None:
        raise ConfigError(f"optimizer.weight_decay_mask={decay_mask!r}: optax.{name} has no weight decay to mask. "
                          "Leave the key out, or use an optimizer with weight decay (adamw, lion, lamb, ...).")
    if mask_arg is not None and mask_arg not in spec:
        mask = _decay_mask("matrices" if decay_mask is None else decay_mask)
        if mask is not None:
            spec[mask_arg] = mask
    try:
        return make(**spec)
    except TypeError as error:
        raise ConfigError(f"optimizer {name!r}: {error}. Its arguments come from the keys of optimizer "
                          "other than name.") from error


#: The argument through which an optax optimizer takes its weight decay's mask.
_MASK_ARGS = ("mask", "weight_decay_mask")


def matrices(params: Any) -> Any:
    """True for every parameter of 2 or more dimensions (kernels, embeddings), False for
    the others and for those Flax names `bias` or `scale` whatever their shape (a
    multi-head projection's bias is 2-D): the weight decay mask of `weight_decay_mask:
    "matrices"`."""
    def decays(path, leaf):
        name = getattr(path[-1], "key", getattr(path[-1], "name", None)) if path else None
        return np.ndim(leaf) >= 2 and name not in _NOT_MATRICES

    return jax.tree_util.tree_map_with_path(decays, params)


#: Parameter names that hold no matrix, whatever their shape.
_NOT_MATRICES = ("bias", "scale")


def _decay_mask(value: Any) -> Callable[[Any], Any] | None:
    """The mask function of `optimizer.weight_decay_mask` (None: every parameter decays)."""
    if value == "matrices":
        return matrices
    if value == "all":
        return None
    if not isinstance(value, str) or ("." not in value and ":" not in value):
        raise ConfigError(f"optimizer.weight_decay_mask={value!r}: give 'matrices' (the default), 'all', or the "
                          "import path of a function of the parameters that returns a tree of bools, e.g. "
                          "'my_project.masks:no_embeddings'.")
    mask = resolve(value, "optimizer.weight_decay_mask")
    if not callable(mask):
        raise ConfigError(f"optimizer.weight_decay_mask={value!r} is {mask!r}, not a function of the parameters.")
    return mask


def _schedule(schedule: dict[str, Any]) -> Callable[[Any], Any]:
    """The optax schedule of `optimizer.learning_rate` (`{"name": ..., its arguments}`)."""
    name = pop_key(schedule, "name", "optimizer.learning_rate.name")
    make = _optax(name, "optimizer.learning_rate.name")
    try:
        return make(**schedule)
    except TypeError as error:
        takes = ", ".join(inspect.signature(make).parameters)
        raise ConfigError(
            f"optimizer.learning_rate: {error}; optax.{name} takes {takes}. To switch to another schedule, give "
            f"the whole section in one override: --config.optimizer.learning_rate=\"{{'name': '{name}', ...}}\" "
            "with its arguments.") from error


def _optax(name: str, key: str) -> Callable[..., Any]:
    fn = getattr(optax, name, None) if isinstance(name, str) else None
    if not callable(fn):
        public = [n for n in dir(optax) if not n.startswith("_")]
        near = difflib.get_close_matches(str(name), public, n=1)
        raise ConfigError(f"{key}={name!r} is not an optax function." + (f" Did you mean {near[0]!r}?" if near else ""))
    return fn


def hooks_of(config: Mapping[str, Any], *, steps: int, eval_fn: Callable, eval_batches: list, workdir: str,
             eval_metrics: Mapping[str, Any] | None = None) -> tuple[list[Any], list[Any], list[Any]]:
    """The hooks of a run: a `StopAtStepHook` at `steps` and those of the `hooks` section.

    Args:
      config: the experiment config.
      steps: the last step (also `ProgressBarHook`'s default `total_steps`).
      eval_fn: `EvalHook`'s default `eval_fn`.
      eval_batches: `EvalHook`'s default `data`.
      eval_metrics: `EvalHook`'s default `metrics` (the task's).
      workdir: the default `output_dir` of every hook that takes one (`EvalHook`,
        `SummarySaverHook`, `StepCounterHook`, `ProfilerHook`, ...), on process 0,
        without a `summary_writer`.

    Returns:
      The hooks, the chief-only hooks, and the `EvalHook`s that evaluate with `eval_fn`.
    """
    hooks, chief_only_hooks, evals = [jaxmon.StopAtStepHook(last_step=steps)], [], []
    for i, spec in enumerate(get_key(config, "hooks", list, [])):
        hook, chief_only = _hook(spec, f"hooks.{i}", steps=steps, eval_fn=eval_fn, eval_batches=eval_batches,
                                 workdir=workdir, eval_metrics=eval_metrics)
        (chief_only_hooks if chief_only else hooks).append(hook)
        if isinstance(hook, jaxmon.EvalHook) and hook.eval_fn is eval_fn:
            evals.append(hook)
    return hooks, chief_only_hooks, evals


def _hook(spec: Any, key: str, *, steps: int, eval_fn: Callable, eval_batches: list, workdir: str,
          eval_metrics: Mapping[str, Any] | None) -> Any:
    """The hook of one entry of `hooks` (at `key`), and whether it is chief-only."""
    if not isinstance(spec, Mapping) or "name" not in spec:
        raise ConfigError(f"{key} must be a dict with a name, e.g. {{'name': 'EvalHook', 'every_n_steps': 500}}; "
                          f"got {spec!r}.")
    args = dict(spec)
    name = args.pop("name")
    chief_only = args.pop("chief_only", name == "ProgressBarHook")
    if not isinstance(chief_only, bool):
        raise ConfigError(f"{key}.chief_only must be True or False; got {chief_only!r}.")
    cls = _hook_class(name, key)
    if cls is jaxmon.EvalHook:
        args.setdefault("eval_fn", eval_fn)
        args.setdefault("data", eval_batches)
        if eval_metrics and args["eval_fn"] is eval_fn:
            args.setdefault("metrics", dict(eval_metrics))
    elif cls is jaxmon.ProgressBarHook:
        args.setdefault("total_steps", steps)
    if ("summary_writer" not in args and jax.process_index() == 0  # one process writes event files
            and "output_dir" in _parameters(cls)):
        args.setdefault("output_dir", workdir)
    try:
        return cls(**args), chief_only
    except (TypeError, ValueError) as error:
        raise ConfigError(f"{key} ({name}): {error}") from error


def _parameters(cls: type) -> Mapping[str, Any]:
    try:
        return inspect.signature(cls).parameters
    except (TypeError, ValueError):
        return {}


def _hook_class(name: Any, key: str) -> Any:
    """The hook class `name` names: a jaxmon hook's name, or an import path."""
    if not (isinstance(name, str) and name.isidentifier()):
        return resolve(name, f"{key}.name")
    cls = getattr(jaxmon, name) if name in jaxmon.__all__ else None  # loads its module: its errors show
    if not (isinstance(cls, type) and issubclass(cls, jaxmon.Hook)):
        hooks = sorted(n for n in dir(jaxmon) if n.endswith("Hook") and n[0].isupper())
        near = difflib.get_close_matches(name, hooks, n=1)
        raise ConfigError(f"{key}.name={name!r} is not a jaxmon hook." + (f" Did you mean {near[0]!r}?" if near
                          else "") + f" jaxmon's hooks: {', '.join(hooks)}; or give an import path 'pkg.mod:Hook'.")
    return cls


def session_args_of(config: Mapping[str, Any]) -> dict[str, Any]:
    """The `session` section, checked against what `MonitoredTrainingSession` takes,
    with the top-level `warm_start` if set.

    Raises:
      ConfigError: a key is one the experiment sets itself, or no argument of the session.
    """
    args = dict(get_key(config, "session", dict, {}))
    parameters = {name: parameter for cls in (jaxmon.MonitoredSession, MonitoredTrainingSession)
                  for name, parameter in inspect.signature(cls.__init__).parameters.items()
                  if name not in ("self", "kwargs")}
    known = set(parameters)
    for name in args:
        if name in PERF_FIGURES:
            raise ConfigError(f"session.{name} goes in the perf section: give perf.{name} instead.")
        if name in _RESERVED:
            raise ConfigError(f"session.{name} is set by the experiment itself; remove it from the config.")
        if name not in known:
            near = difflib.get_close_matches(name, sorted(known - _RESERVED), n=1)
            raise ConfigError(f"session.{name} is not an argument of MonitoredTrainingSession."
                              + (f" Did you mean session.{near[0]}?" if near else "")
                              + f" It takes: {', '.join(sorted(known - _RESERVED))}.")
        kind = _kind_of(parameters[name].annotation)
        if kind is not None:
            check_kind(f"session.{name}", args[name], kind)
    if config.get("warm_start") is not None:
        args["warm_start"] = config["warm_start"]
    return args


#: The kinds of a session argument's annotation, by the names its union is written with.
_KINDS = {"int": INT, "float": NUMBER, "str": TEXT, "bool": FLAG}


def _kind_of(annotation: Any) -> Kind | None:
    """The kind a session argument annotated `annotation` takes ("int | None": an int or
    None); None where the annotation names any other type (a path, a callable, a mesh):
    the session checks those itself."""
    text = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", str(annotation))
    names = [name.strip() for name in text.split("|")]
    kinds = [_KINDS.get(name) for name in names if name != "None"]
    if not kinds or None in kinds:
        return None
    union = Kind(lambda value: any(each.accepts(value) for each in kinds), " or ".join(each.words for each in kinds))
    return union.or_none() if "None" in names else union


def throughput_of(config: Mapping[str, Any], step_fn: Callable[..., Any], *, batch_size: int, row: Any,
                  workdir: str, model: Any = None) -> Throughput:
    """The `perf` section's hook (`every_n_steps`, default 100, and `PERF_FIGURES`, each None
    by default), which logs each write and takes the place of the session's own. Unless
    the section gives them, a step counts `batch_size` examples (all processes: each step
    is one batch of `data.batch_size` rows, with accumulated gradients too), and for the
    "lm" task the tokens of those rows (`row`: one example's input) and, on
    `jaxmon.models.Transformer` (`model`), the FLOPs of its model count; other steps'
    FLOPs are XLA's count."""
    perf = dict(get_key(config, "perf", dict, {}))
    every = perf.pop("every_n_steps", 100)
    figures = {name: perf.pop(name, None) for name in PERF_FIGURES}
    if perf:
        raise ConfigError(f"perf has unknown keys {sorted(perf)}; it takes every_n_steps, {', '.join(PERF_FIGURES)}.")
    for name, value in figures.items():
        try:
            check_figures("perf", **{name: value})
        except (TypeError, ValueError):
            raise ConfigError(f"perf.{name}={value!r}: give {FIGURES[name]} (a number > 0), or None.") from None
    lm = config.get("task") == "lm"
    tokens = batch_size * int(np.size(row)) if lm else None
    flops = _model_flops(model, tokens, int(np.shape(row)[-1])) if lm and isinstance(model, Transformer) else None
    given = {name: value for name, value in figures.items() if value is not None}
    figures = {"examples_per_step": batch_size, "tokens_per_step": tokens, "flops_per_step": flops, **given}
    return Throughput(step_fn, **figures, every_n_steps=every, output_dir=workdir, log=True)


def _model_flops(model: Transformer, tokens: int, length: int) -> Callable[[Any, Any], float]:
    """The FLOPs of a step of `tokens` tokens in rows of `length` through `model`, by its
    model count, from the shapes of the state's parameters (on the perf thread)."""
    def flops(state: Any, batch: Any) -> float:
        return tokens * transformer_flops_per_token(model, state.params, length)

    return flops
