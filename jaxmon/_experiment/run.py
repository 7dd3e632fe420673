"""A training run described by a config: data, model, task, optimizer, hooks, session."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np
import optax

from jaxmon import _loaders
from jaxmon._checkpoint import DirectoryInUseError
from jaxmon._data import ArrayDataSource
from jaxmon._experiment import tasks
from jaxmon._experiment.config_file import ConfigError
from jaxmon._experiment.keys import TOP_LEVEL, check_top_level, get_key, pop_key, resolve
from jaxmon._experiment.mesh import Layout, layout_of, mesh_of
from jaxmon._experiment.same_run import SAME_RUN, report_changes
from jaxmon._experiment.sections import hooks_of, optimizer_of, session_args_of
from jaxmon._training import MonitoredTrainingSession
from jaxmon.hooks import EvalHook

__all__ = ["SAME_RUN", "TOP_LEVEL", "train_experiment", "use_compilation_cache"]


def train_experiment(config: Mapping[str, Any], workdir: str | os.PathLike,
                     report: Callable[[str], None] = print, *,
                     compilation_cache: bool | str | os.PathLike = True) -> dict[str, Any]:
    """Trains the experiment `config` describes, in `workdir` (checkpoints, TensorBoard
    event files, `metrics.jsonl`), resuming from the latest checkpoint there.

    The config (see `configs/default.py`):
      - `seed` (int), `steps` (the last step: `StopAtStepHook(last_step=steps)`);
      - `data`: `source` (import path of `fn(split, **rest) -> {"x": ..., "y": ...}`,
        e.g. `"jaxmon.datasets:digits"`), `batch_size`, `eval_split` (default
        "test"), `eval_batch_size` (default: the whole split in one batch), `loader`
        ("arrays": `jm.ArrayDataSource`; "grain": a grain pipeline, shuffled each
        epoch, with `worker_count` worker processes, default 2), and any other keys
        for `source`. Either loader resumes exactly;
      - `model`: `name` (import path of a Flax linen module) and its arguments;
      - `task`: "classification" (softmax cross-entropy and accuracy on integer
        labels), "regression" (mean squared error), "lm" (next-token cross-entropy
        on `y`, 0 is padding; token-weighted eval loss, perplexity and accuracy), the
        import path of `fn(predictions, batch) -> (loss, {metric: value})`, or that of
        a user's `make_task(context) -> jm.Task` (see `jm.Task`, `jm.TaskContext`);
      - `optimizer`: `name` of an optax optimizer and its arguments (a
        `learning_rate` may itself be `{"name": <optax schedule>, ...}`), and
        `clip_global_norm` (gradient clipping) and `accumulate_steps` (gradients
        accumulated over that many steps per update, `optax.MultiSteps`);
      - `mesh` and `sharding`: the devices' named axes and where the state and the
        batches live on them (see `jaxmon/_experiment/mesh.py`); None: one device
        (with several JAX processes: a `data` axis over every device);
      - `hooks`: a list of `{"name": <jaxmon hook or import path>, ...arguments}`.
        `EvalHook` gets the eval function and the eval split, `ProgressBarHook` the
        number of steps, every hook that takes an `output_dir` the run's directory,
        unless given. Modules next to the config file import by name;
      - `session`: arguments of `MonitoredTrainingSession` (`hparams` defaults to the
        whole config, flattened: TensorBoard's HParams dashboard; periods of checkpoints,
        summaries and the step counter, `max_to_keep`, `warm_start`, ...).

    Args:
      config: the experiment config (see `load_config`), stored with every
        checkpoint and written to TensorBoard as text.
      workdir: the run's directory.
      report: where the lines for the person running it go (the resume notice, the
        final result).
      compilation_cache: keep the compiled programs in JAX's persistent compilation
        cache, so that a restarted run does not compile them again: True (in
        `workdir/compilation_cache`), a directory (one several runs can share), or
        False. A cache directory already configured for JAX
        (`JAX_COMPILATION_CACHE_DIR`) is used as it is.

    Returns:
      The final evaluation on the eval split: `{"step": ..., "loss": ..., <metrics>}`.
    """
    _check_workdir(workdir)
    if compilation_cache is not False:
        use_compilation_cache(os.path.join(workdir, "compilation_cache") if compilation_cache is True
                              else compilation_cache)
    try:
        experiment = _build(config, workdir, report)
    except (TypeError, ValueError) as error:
        if isinstance(error, ConfigError):
            raise
        raise ConfigError(f"A value of the config was refused: {error}") from error
    return _run(experiment, report)


def _check_workdir(workdir: str | os.PathLike) -> None:
    """Creates `workdir` if needed; a ConfigError if it is a file or cannot be written."""
    workdir = os.fspath(workdir)
    if os.path.exists(workdir) and not os.path.isdir(workdir):
        raise ConfigError(f"The run directory {workdir!r} is a file, not a directory: give --workdir a directory "
                          "(created if it does not exist).")
    try:
        os.makedirs(workdir, exist_ok=True)
        probe = os.path.join(workdir, f".jaxmon-write-test-{os.getpid()}")
        with open(probe, "w"):
            pass
        os.remove(probe)
    except OSError as error:
        raise ConfigError(f"Cannot write the run directory {workdir!r}: {error.strerror or error}; give --workdir "
                          "a directory this user can write.") from error


def use_compilation_cache(directory: str | os.PathLike) -> str:
    """Turns JAX's persistent compilation cache on in `directory` for every program,
    however quickly it compiled (JAX's default keeps only those over a second); returns
    the directory in use, which is one configured before if there was one."""
    current = jax.config.jax_compilation_cache_dir
    if current:
        return current
    directory = os.path.abspath(os.fspath(directory))
    os.makedirs(directory, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", directory)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    return directory


@dataclasses.dataclass(frozen=True)
class _Experiment:
    """A run built from its config: what the session takes, and what the final
    evaluation and the report lines need."""

    config: dict[str, Any]
    workdir: str
    steps: int
    init_fn: Callable[[], Any]
    step_fn: Callable[..., Any]
    eval_fn: Callable[..., dict[str, Any]]
    eval_metrics: Mapping[str, Any] | None
    data: Any  # ArrayDataSource, or a grain pipeline
    eval_split: Any
    eval_batches: list[dict[str, np.ndarray]]
    hooks: list[Any]
    chief_only_hooks: list[Any]
    evals: list[Any]
    session_args: dict[str, Any]
    layout: Layout | None


@dataclasses.dataclass(frozen=True)
class _Data:
    """The `data` section, loaded: the train and eval splits and how to batch them."""

    train: Mapping[str, Any]
    evaluation: Mapping[str, Any]
    batch_size: Any
    eval_split: Any
    eval_batch_size: int | None
    loader: str
    worker_count: int


def _build(config: Mapping[str, Any], workdir: str | os.PathLike, report: Callable[[str], None]) -> _Experiment:
    """Reads and checks `config`, loads the data and builds the model, the functions
    and the hooks; on resume, reports the config changes since the latest checkpoint.

    Raises:
      ConfigError: `config` is not a valid experiment config, or it changes what the
        checkpoints in `workdir` depend on.
    """
    config = dict(config)
    check_top_level(config)
    workdir = os.fspath(workdir)
    seed = get_key(config, "seed", int, 0)
    steps = get_key(config, "steps", int)
    mesh = mesh_of(config.get("mesh"))
    data = _load_data(config)
    task_name = config.get("task", "classification")
    context = tasks.TaskContext(config, _model(config), _optimizer(config), seed,
                                {key: np.asarray(value[:2]) for key, value in data.train.items()}, mesh)
    task = tasks.task_of(task_name)(context)
    init_fn, layout = task.init_fn, None
    if mesh is not None:
        layout = layout_of(config, mesh, context, task.init_fn, built_in=tasks.is_built_in(task_name))
        layout.check(jax.eval_shape(task.init_fn), data.batch_size)
        if tasks.is_built_in(task_name) or config.get("sharding"):
            init_fn = layout.sharded_init(task.init_fn)
    eval_batches = _batches(data.evaluation, data.eval_batch_size)
    hooks, chief_only_hooks, evals = hooks_of(config, steps=steps, eval_fn=task.eval_fn, eval_batches=eval_batches,
                                               workdir=workdir, eval_metrics=task.eval_metrics)
    session_args = session_args_of(config)
    report_changes(config, workdir, report)
    train_data = _train_data(data, seed)
    return _Experiment(config, workdir, steps, init_fn, task.step_fn, task.eval_fn, task.eval_metrics, train_data,
                       data.eval_split, eval_batches, hooks, chief_only_hooks, evals, session_args, layout)


def _load_data(config: Mapping[str, Any]) -> _Data:
    """Calls the `data.source` function for the train and eval splits."""
    data = dict(get_key(config, "data", dict))
    source = resolve(pop_key(data, "source", "data.source"), "data.source")
    batch_size = pop_key(data, "batch_size", "data.batch_size")
    eval_split = data.pop("eval_split", "test")
    eval_batch_size = data.pop("eval_batch_size", None)
    loader, worker_count = data.pop("loader", "arrays"), data.pop("worker_count", 2)
    if loader not in ("arrays", "grain"):
        raise ConfigError(f"data.loader={loader!r}: give 'arrays' (jm.ArrayDataSource) or 'grain'.")
    if not isinstance(worker_count, int) or isinstance(worker_count, bool) or worker_count < 0:
        raise ConfigError(f"data.worker_count={worker_count!r}: give a number of grain worker processes >= 0.")
    return _Data(source("train", **data), source(eval_split, **data), batch_size, eval_split, eval_batch_size,
                 loader, worker_count)


def _train_data(data: _Data, seed: int) -> Any:
    """The training batches, reshuffled each epoch, resumable exactly. With several
    processes each reads its own rows of every global batch (the same rows whatever
    the number of processes)."""
    if data.loader == "grain":
        if jax.process_count() > 1:
            raise ConfigError("data.loader='grain' reads every row on each process; with several processes give "
                              "data.loader='arrays'.")
        arrays = {key: np.asarray(value) for key, value in data.train.items()}
        return _loaders.array_pipeline(arrays, data.batch_size, seed=seed, worker_count=data.worker_count)
    source = ArrayDataSource(data.train, data.batch_size, shuffle=True, seed=seed)
    return source if jax.process_count() == 1 else _ProcessRows(source, jax.process_index(), jax.process_count())


class _ProcessRows:
    """This process's rows of each batch of `source`: part `index` of `count` equal parts
    (the devices of process i hold part i of a batch split on its leading axis)."""

    def __init__(self, source: ArrayDataSource, index: int, count: int):
        self._source, self._index, self._count = source, index, count

    def __iter__(self) -> _ProcessRows:
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        batch = next(self._source)
        rows = len(next(iter(batch.values()))) // self._count
        return {key: value[self._index * rows:(self._index + 1) * rows] for key, value in batch.items()}

    def get_state(self) -> Any:
        return self._source.get_state()

    def set_state(self, state: Any) -> None:
        self._source.set_state(state)


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


def _run(experiment: _Experiment, report: Callable[[str], None]) -> dict[str, Any]:
    """Trains `experiment` to its last step (resuming if it can), then evaluates the
    final state on the eval split, unless the session stopped early.

    Returns:
      `train_experiment`'s result.
    """
    session = _open_session(experiment)
    _report_resume(session, experiment, report)
    with session:
        while not session.should_stop():
            session.run()
    stopped = _stopped_early(session, report)
    return stopped if stopped is not None else _final_evaluation(experiment, session, report)


def _open_session(experiment: _Experiment) -> MonitoredTrainingSession:
    """The session of `experiment` (restored from its workdir if it holds a checkpoint).

    Raises:
      ConfigError: the session rejects its arguments (a `TypeError` or `ValueError`).
    """
    e = experiment
    try:
        placed = {} if e.layout is None else {"mesh": e.layout.mesh, "batch_sharding": e.layout.batch_sharding}
        return MonitoredTrainingSession(e.step_fn, e.init_fn, data=e.data, checkpoint_dir=e.workdir, hooks=e.hooks,
                                        chief_only_hooks=e.chief_only_hooks, config=e.config, **placed,
                                        **{"hparams": e.config, **e.session_args})  # the config is the run's hparams
    except (TypeError, ValueError) as error:
        raise ConfigError(f"Creating the session from the config failed: {type(error).__name__}: {error}") from error
    except DirectoryInUseError as error:
        raise ConfigError(str(error)) from error


def _report_resume(session: MonitoredTrainingSession, experiment: _Experiment, report: Callable[[str], None]) -> None:
    """Reports the step `session` resumed from and what is left to do; nothing on a fresh start."""
    if session.restored_step is None:
        return
    steps = experiment.steps
    left = (f"already at the last step ({steps}): evaluating only" if session.restored_step >= steps
            else f"training on to step {steps}")
    report(f"Resumed from step {session.restored_step} in {experiment.workdir}; {left}.")


def _stopped_early(session: MonitoredTrainingSession, report: Callable[[str], None]) -> dict[str, Any] | None:
    """The result of a session stopped by SIGTERM or by a rejected state, reported;
    None if it ran to its end."""
    if session.preemption_requested:
        report(f"Stopped by SIGTERM at step {session.step}; the checkpoint is saved: run the same command to resume.")
        return {"step": session.step, "stopped": "SIGTERM", "exit_code": 143}
    if session.state_rejected:
        report(f"Stopped early at step {session.step}: {session.state_rejected}.")
        return {"step": session.step, "stopped": session.state_rejected, "exit_code": 1}
    return None


def _final_evaluation(experiment: _Experiment, session: MonitoredTrainingSession,
                      report: Callable[[str], None]) -> dict[str, Any]:
    """The final state's metrics on the eval split, reported: `{"step": ..., <metrics>}`."""
    means = _final_means(experiment, session)
    result = {"step": session.step, **means}
    shown = ", ".join(f"{name} {value:.4f}" for name, value in means.items())
    report(f"step {session.step}: {experiment.eval_split} {shown}  ({experiment.workdir})")
    return result


def _final_means(experiment: _Experiment, session: MonitoredTrainingSession) -> dict[str, Any]:
    """The eval split's metrics at the session's last step: an `EvalHook`'s, if it
    evaluated that step, else a fresh evaluation with the task's eval metrics."""
    done = [hook.latest for hook in experiment.evals if hook.history and hook.history[-1][0] == session.step]
    if done:  # the EvalHook evaluated the final state at end: the same batches, the same function
        return dict(done[0])
    evaluation = EvalHook(experiment.eval_fn, experiment.eval_batches, metrics=experiment.eval_metrics)
    return evaluation.evaluate(session)


def _batches(arrays: Mapping[str, np.ndarray], batch_size: int | None) -> list[dict[str, np.ndarray]]:
    n = len(next(iter(arrays.values())))
    size = n if batch_size is None else batch_size
    return [{k: np.asarray(v[i:i + size]) for k, v in arrays.items()} for i in range(0, n, size)]
