"""A training run described by a config: data, model, task, optimizer, hooks, session."""

from __future__ import annotations

import dataclasses
import fcntl
import logging
import os
import shutil
import signal
import time
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np

from jaxmon._base.errors import ConfigError
from jaxmon._base.paths import LinkedFileError, is_full_disk, open_fd, open_file
from jaxmon._checkpoints.manager import _LOCK_NAME, DirectoryInUseError
from jaxmon._experiment.keys import TOP_LEVEL, check_keys
from jaxmon._experiment.mesh import Layout
from jaxmon._experiment.parts import parts_of, train_data
from jaxmon._experiment.same_run import SAME_RUN, report_changes
from jaxmon._experiment.sections import hooks_of, session_args_of, throughput_of
from jaxmon._experiment.trackers import writers_of
from jaxmon._ops import time_spent
from jaxmon._run.training import MonitoredTrainingSession
from jaxmon.hooks import EvalHook

logger = logging.getLogger("jaxmon")

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
        on `y`, `data.pad_id` masked; token-weighted eval loss, perplexity and accuracy), the
        import path of `fn(predictions, batch) -> (loss, {metric: value})`, or that of
        a user's `make_task(context) -> jm.Task` (see `jm.Task`, `jm.TaskContext`);
      - `optimizer`: `name` of an optax optimizer and its arguments (a
        `learning_rate` may itself be `{"name": <optax schedule>, ...}`), and
        `clip_global_norm` (gradient clipping) and `accumulate_steps` (each step's
        batch split into that many micro-batches, one update of their mean gradient);
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
    began, process = time.perf_counter(), time_spent.process_seconds()
    created = _check_workdir(workdir)
    try:  # a refusal (ConfigError) before training removes the directories this call created
        try:
            experiment = _build(config, workdir, report)
        except (TypeError, ValueError, OverflowError) as error:
            if isinstance(error, ConfigError):
                raise
            raise ConfigError(f"A value of the config was refused: {type(error).__name__}: {error}") from error
        if compilation_cache is not False:
            use_compilation_cache(os.path.join(workdir, "compilation_cache") if compilation_cache is True
                                  else compilation_cache)
        built = time.perf_counter()
        session = _open_session(experiment)
        opened, created = time.perf_counter(), dict(session.time_spent.secs)
    except ConfigError:
        _remove_created(os.fspath(workdir), created)
        raise
    before = {"imports and config": process or 0.0, "data and model": built - began}

    def start_up() -> str:
        total = time.perf_counter() - began + (process or 0.0)
        parts = time_spent.start_up(before, created, opened - built, session.time_spent.secs, total)
        return f"Step {session.step} after {total:.2f} s: {', '.join(f'{k} {v:.2f} s' for k, v in parts.items())}."

    return _run(experiment, session, report, start_up)


def _check_workdir(workdir: str | os.PathLike) -> list[str]:
    """Creates `workdir` if needed; a ConfigError if it is a file or cannot be written.

    Returns:
      The directories created, `workdir` first, then those of its parents that were
      created with it (innermost first); empty if `workdir` existed.
    """
    workdir = os.fspath(workdir)
    if os.path.exists(workdir) and not os.path.isdir(workdir):
        raise ConfigError(f"The run directory {workdir!r} is a file, not a directory: give --workdir a directory "
                          "(created if it does not exist).")
    created, missing = [], os.path.abspath(workdir)
    while not os.path.exists(missing) and os.path.dirname(missing) != missing:
        created.append(missing)
        missing = os.path.dirname(missing)
    try:
        os.makedirs(workdir, exist_ok=True)
        probe = os.path.join(workdir, f".jaxmon-write-test-{os.getpid()}")
        with open_file(probe, "w", fresh=True):  # a link of that name is removed, not written through
            pass
        os.remove(probe)
    except OSError as error:
        _remove_created(workdir, created)
        fix = ("free space there, or give --workdir a directory on a disk with room" if is_full_disk(error) else
               "give --workdir a directory this user can write")
        raise ConfigError(f"Cannot write the run directory {workdir!r}: {error.strerror or error}; {fix}.") from error
    return created


def _remove_created(workdir: str, created: list[str]) -> None:
    """Removes the run directory `workdir` of a refused run, and the parents created
    with it, if this call created it (`created`, from `_check_workdir`): unless it
    holds a checkpoint, or another run holds its writer's lock (it is that run's now).
    A directory that existed before is never touched, nor one that other processes of
    the run (`jax.distributed`) may be writing to."""
    if not created or created[0] != os.path.abspath(workdir) or jax.distributed.is_initialized():
        return
    if any(name.isdigit() for name in _names(workdir)):  # a checkpoint's directory, complete or not
        return
    lock = os.path.join(workdir, _LOCK_NAME)
    fd = open_fd(lock, os.O_RDONLY) if os.path.isfile(lock) else None
    try:
        if fd is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:  # held: by this process's own session, or by another run
                if not os.pread(fd, 4096, 0).decode(errors="replace").startswith(f"pid {os.getpid()} "):
                    return
        shutil.rmtree(workdir, ignore_errors=True)
    finally:
        if fd is not None:
            os.close(fd)
    for parent in created[1:]:
        try:
            os.rmdir(parent)
        except FileNotFoundError:  # never made (makedirs failed above it)
            continue
        except OSError:  # something else is there now
            return


def _names(directory: str) -> list[str]:
    try:
        return os.listdir(directory)
    except OSError:
        return []


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
    writers: list[Any]


def _build(config: Mapping[str, Any], workdir: str | os.PathLike, report: Callable[[str], None]) -> _Experiment:
    """Reads and checks `config`, loads the data and builds the model, the functions
    and the hooks; on resume, reports the config changes since the latest checkpoint.

    Raises:
      ConfigError: `config` is not a valid experiment config, or it changes what the
        checkpoints in `workdir` depend on.
    """
    config = dict(config)
    check_keys(config)
    session_args = session_args_of(config)  # before the data loads: a session key's error is said at once
    workdir = os.fspath(workdir)
    writers = writers_of(config.get("writers"), workdir)  # a tracker's missing package too
    parts = parts_of(config)
    task = parts.task
    hooks, chief_only_hooks, evals = hooks_of(config, steps=parts.steps, eval_fn=task.eval_fn,
                                               eval_batches=parts.eval_batches, workdir=workdir,
                                               eval_metrics=task.eval_metrics)
    chief_only_hooks.append(throughput_of(config, task.step_fn, batch_size=parts.data.batch_size,
                                          row=parts.data.example["x"][0], workdir=workdir, model=parts.context.model))
    report_changes(config, workdir, report)
    return _Experiment(config, workdir, parts.steps, parts.init_fn, task.step_fn, task.eval_fn, task.eval_metrics,
                       train_data(parts.data, parts.seed), parts.data.eval_split, parts.eval_batches, hooks,
                       chief_only_hooks, evals, session_args, parts.layout, writers)


def _run(experiment: _Experiment, session: MonitoredTrainingSession, report: Callable[[str], None],
         start_up: Callable[[], str]) -> dict[str, Any]:
    """Trains `experiment` in its `session` to its last step (resumed if it could),
    then evaluates the final state on the eval split, unless the session stopped early.
    The first run is followed by the start-up line (`start_up()`, logged): the seconds
    from the process's start (where the OS says when it was; else from
    `train_experiment`) to the first step, and where they went.

    Returns:
      `train_experiment`'s result.
    """
    _report_resume(session, experiment, report)
    with session:
        if not session.should_stop():
            session.run()
            logger.info(start_up())
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
                                        writers=e.writers,
                                        **{"hparams": e.config, **e.session_args})  # the config is the run's hparams
    except ConfigError:  # the state's initialisation names the model's values
        raise
    except (TypeError, ValueError) as error:
        raise ConfigError(f"Creating the session from the config failed: {type(error).__name__}: {error}") from error
    except (DirectoryInUseError, LinkedFileError) as error:  # the workdir cannot be used as it is
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
    """The result of a session stopped by SIGTERM, SIGHUP (the session logged it; the
    command's last line says it) or a rejected state (reported), with its exit code (128
    + the signal's number); None if it ran to its end."""
    if session.preemption_requested:
        signum = signal.Signals(session.preemption_signal or signal.SIGTERM)
        return {"step": session.step, "stopped": signum.name, "exit_code": 128 + signum}
    if session.state_rejected:
        report(f"Stopped early at step {session.step}: {session.state_rejected}.")
        return {"step": session.step, "stopped": session.state_rejected, "exit_code": 1}
    return None


def _final_evaluation(experiment: _Experiment, session: MonitoredTrainingSession,
                      report: Callable[[str], None]) -> dict[str, Any]:
    """The final state's metrics on the eval split, reported (the task's eval metrics
    where it names some, else every output): `{"step": ..., <metrics>}`."""
    means = _final_means(experiment, session)
    result = {"step": session.step, **means}
    names = [name for name in experiment.eval_metrics or means if name in means]
    shown = ", ".join(f"{name} {means[name]:.4f}" for name in names)
    report(f"step {session.step}: {experiment.eval_split} {shown}  ({experiment.workdir})")
    return result


def _final_means(experiment: _Experiment, session: MonitoredTrainingSession) -> dict[str, Any]:
    """The eval split's metrics at the session's last step: an `EvalHook`'s, if it
    evaluated that step in this run, else a fresh evaluation with the task's eval
    metrics (a run resumed at its last step evaluates the restored state: a hook's
    history restored with it may be of another eval split)."""
    trained = session.restored_step is None or session.step > session.restored_step
    done = [hook.latest for hook in experiment.evals
            if trained and hook.history and hook.history[-1][0] == session.step]
    if done:  # the EvalHook evaluated the final state at end: the same batches, the same function
        return dict(done[0])
    evaluation = EvalHook(experiment.eval_fn, experiment.eval_batches, metrics=experiment.eval_metrics)
    return evaluation.evaluate(session)
