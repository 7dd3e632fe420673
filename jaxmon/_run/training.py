"""MonitoredTrainingSession: a MonitoredSession with TF's standard services added."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import jax
import numpy as np

from jaxmon._base import errors as _errors
from jaxmon._base.hook import Hook
from jaxmon._metrics.accumulators import Declared
from jaxmon._run.session import MonitoredSession
from jaxmon._writers import SummaryWriterCache
from jaxmon.hooks import CheckpointSaverHook, GoodputHook, StepCounterHook, SummarySaverHook
from jaxmon.hooks._throughput import Throughput, check_figures

#: TF's `USE_DEFAULT`: an argument not given, as opposed to one given as None.
USE_DEFAULT: Any = type("UseDefault", (), {"__repr__": lambda self: "USE_DEFAULT"})()


class MonitoredTrainingSession(MonitoredSession):
    """A `MonitoredSession` with the standard services of a training job (TF's
    `MonitoredTrainingSession`, and what its `Supervisor` did).

    On the chief (by default `jax.process_index() == 0`) the hooks are, in TF's order:
    `chief_only_hooks`, then a `StepCounterHook` (every `log_step_count_steps`) and a
    `SummarySaverHook` writing into `summary_dir` (with, at its cadence, a `GoodputHook`:
    where the run's time went, and `perf/*` summaries: steps, examples and tokens per
    second, TFLOP/s per device and MFU, see docs/performance.md), then a
    `CheckpointSaverHook` into `checkpoint_dir`, then `hooks`. Other processes get
    `hooks` only, plus the `CheckpointSaverHook` when there are several JAX processes
    (Orbax saves collectively; process 0 writes the metadata). Every process restores
    the latest checkpoint of `checkpoint_dir` at creation, and the saver writes a last
    checkpoint at close.

    Defaults, as TF resolves them: neither `save_summaries_steps` nor
    `save_summaries_secs` given → every 100 steps; neither `save_checkpoint_secs` nor
    `save_checkpoint_steps` given → every 600 seconds; giving one turns the other off.
    A value of 0 or None turns a service off. Giving both for one service (TF's
    docstring said one wins; its code raised) is a `ValueError`.

    Args:
      step_fn, init_fn, state, data: as for `MonitoredSession`.
      checkpoint_dir: where to restore from and save checkpoints; None: no checkpoints.
      is_chief: this process writes summaries and runs `chief_only_hooks`; None:
        `jax.process_index() == 0`.
      hooks: hooks for every process, after the standard ones.
      chief_only_hooks: hooks for the chief only, before the standard ones.
      save_checkpoint_secs, save_checkpoint_steps: the checkpoint period.
      save_summaries_steps, save_summaries_secs: the summary period (every scalar
        output of the step).
      log_step_count_steps: the `global_step/sec` period; 0 or None: none.
      summary_dir: where summaries go; default `checkpoint_dir`.
      hparams: hyper-parameters (a dict, possibly nested), written once per run (not
        again on resume) to TensorBoard's HParams plugin and `hparams.json` beside
        `metrics.jsonl`, on the chief.
      max_to_keep: how many recent checkpoints the saver keeps.
      stop_grace_period_secs: as for `MonitoredSession`.
      max_wait_secs: accepted for TF's signature. In JAX every process restores the
        same checkpoint together, so no process waits for another to initialise.
      config: a JSON-serialisable dict saved with every checkpoint and, on the chief,
        written to TensorBoard as the text summary `config` once per run (a resume
        writes it again only when it changed).
      writers: more writers of what the chief writes to `summary_dir` (an experiment
        tracker's: `jm.MlflowWriter`), on the report thread with the rest; closed with
        the summaries.
      peak_tflops, flops_per_step, examples_per_step, tokens_per_step: the `perf/*`
        summaries' figures (numbers > 0), each None for jaxmon's own: one device's dense
        peak TFLOP/s (None: jaxmon's table by the device's kind; `perf/mfu` needs one);
        the FLOPs of one step, all devices together (None: XLA's count of the step,
        every loop counted by its trip count); the examples of one step, all processes
        together (None: the leading axis of the step's batch: 4, not 32, for batches of
        4 micro-batches of 8 rows); the tokens of one step (None: no
        `perf/tokens_per_sec`). A figure that cannot be computed is said once in the log.
      **kwargs: anything else `MonitoredSession` takes (`warm_start`,
        `max_recoveries`, `donate_state`, `handle_sigterm`, ...).

    Example:
      >>> import tempfile, jax.numpy as jnp, jaxmon as jm
      >>> def step_fn(state, batch):
      ...     return state + batch, {"loss": state}
      >>> workdir = tempfile.mkdtemp()
      >>> with jm.MonitoredTrainingSession(step_fn, state=jnp.zeros(()), data=[1.0] * 5,
      ...                                  checkpoint_dir=workdir) as sess:
      ...     while not sess.should_stop():
      ...         _ = sess.run()
      >>> jm.latest_checkpoint_step(workdir)
      5
    """

    def __init__(
        self,
        step_fn: Callable[[Any, Any], tuple[Any, Mapping[str, Any]]],
        init_fn: Callable[[], Any] | None = None,
        *,
        state: Any = None,
        data: Iterable[Any] | None = None,
        checkpoint_dir: str | os.PathLike | None = None,
        is_chief: bool | None = None,
        hooks: Iterable[Hook] | None = (),
        chief_only_hooks: Iterable[Hook] | None = (),
        save_checkpoint_secs: float | None = USE_DEFAULT,
        save_checkpoint_steps: int | None = USE_DEFAULT,
        save_summaries_steps: int | None = USE_DEFAULT,
        save_summaries_secs: float | None = USE_DEFAULT,
        log_step_count_steps: int | None = 100,
        summary_dir: str | os.PathLike | None = None,
        max_to_keep: int | None = 5,
        stop_grace_period_secs: float = 120,
        max_wait_secs: float = 7200,
        config: Mapping[str, Any] | None = None,
        hparams: Mapping[str, Any] | None = None,
        writers: Iterable[Any] = (),
        peak_tflops: float | None = None,
        flops_per_step: float | None = None,
        examples_per_step: float | None = None,
        tokens_per_step: float | None = None,
        **kwargs: Any,
    ):
        if hparams is not None and not isinstance(hparams, Mapping):
            raise TypeError(f"MonitoredTrainingSession hparams must be a dict (it may nest); got {hparams!r:.80}.")
        save_summaries_steps, save_summaries_secs = _resolve(
            "save_summaries_steps", save_summaries_steps, "save_summaries_secs", save_summaries_secs, (100, None))
        save_checkpoint_steps, save_checkpoint_secs = _resolve(
            "save_checkpoint_steps", save_checkpoint_steps, "save_checkpoint_secs", save_checkpoint_secs, (None, 600))
        if log_step_count_steps is not None:
            _errors.check_int("log_step_count_steps", log_step_count_steps, minimum=0)
        _errors.check_number("max_wait_secs", max_wait_secs)
        figures = {"peak_tflops": peak_tflops, "flops_per_step": flops_per_step,
                   "examples_per_step": examples_per_step, "tokens_per_step": tokens_per_step}
        check_figures("MonitoredTrainingSession", **figures)
        self.is_chief = jax.process_index() == 0 if is_chief is None else bool(is_chief)
        if checkpoint_dir is not None:
            checkpoint_dir = os.fspath(checkpoint_dir)
        summary_dir = os.fspath(summary_dir) if summary_dir is not None else checkpoint_dir
        self.summary_dir = summary_dir if self.is_chief else None
        self.max_wait_secs = max_wait_secs
        self._summary_handle: Any = None
        self._summaries_closed = False  # after close(): hooks' end() may still write

        hooks = () if hooks is None else hooks
        standard: list[Hook] = []
        if self.is_chief:
            standard.extend(() if chief_only_hooks is None else chief_only_hooks)
            if summary_dir is not None:
                if log_step_count_steps:
                    standard.append(StepCounterHook(every_n_steps=log_step_count_steps, output_dir=summary_dir))
                if save_summaries_steps or save_summaries_secs:
                    standard.append(SummarySaverHook(save_steps=save_summaries_steps, save_secs=save_summaries_secs,
                                                     output_dir=summary_dir))
                    if not any(isinstance(hook, GoodputHook) for hook in hooks):  # yours replaces it
                        standard.append(GoodputHook(output_dir=summary_dir, every_n_steps=save_summaries_steps,
                                                    every_n_secs=save_summaries_secs))
                    if not any(isinstance(hook, Throughput) for hook in standard):  # `jaxmon train`'s replaces it
                        standard.append(Throughput(step_fn, output_dir=summary_dir, every_n_steps=save_summaries_steps,
                                                   every_n_secs=save_summaries_secs, **figures))
        elif jax.process_count() > 1:  # every process compiles the same step: the chief's accumulators, unread
            chief = list(() if chief_only_hooks is None else chief_only_hooks)
            if summary_dir is not None and (save_summaries_steps or save_summaries_secs):
                chief.append(SummarySaverHook(save_steps=save_summaries_steps, save_secs=save_summaries_secs,
                                              output_dir=summary_dir))  # never begun: it opens nothing
            standard.extend(Declared(hook) for hook in chief if hook.accumulators)
        if checkpoint_dir is not None and (save_checkpoint_steps or save_checkpoint_secs) and (
                self.is_chief or jax.process_count() > 1):
            standard.append(CheckpointSaverHook(checkpoint_dir, save_secs=save_checkpoint_secs,
                                                save_steps=save_checkpoint_steps, max_to_keep=max_to_keep))
        for writer in writers if self.summary_dir is not None else ():  # before a hook opens the directory's writer
            SummaryWriterCache.add_writer(self.summary_dir, writer)
        super().__init__(step_fn, init_fn, state=state, data=data, hooks=[*standard, *hooks],
                         checkpoint_dir=checkpoint_dir, config=config,
                         stop_grace_period_secs=stop_grace_period_secs, **kwargs)
        new_config = config is not None and self._life.new_config  # once per run, and after a change
        if self.summary_dir is not None and (new_config or (hparams and self.restored_step is None)):
            try:
                if hparams and self.restored_step is None:  # once per run, first: not again on resume
                    self._summary_writer().write_hparams(hparams)
                if new_config:
                    self.summary_computed({"config": json.dumps(dict(config), indent=2, sort_keys=True, default=str)})
            except BaseException:
                self._close(clean=False)  # release what the hooks' begin() opened
                raise

    def _summary_writer(self) -> Any:
        if self._summary_handle is None:
            self._summary_handle = SummaryWriterCache.get(self.summary_dir)
        return self._summary_handle.writer

    def summary_computed(self, summaries: Mapping[str, Any], step: int | None = None) -> None:
        """Writes summaries you computed yourself into the session's event file and
        `metrics.jsonl` (TF Supervisor's `summary_computed`).

        Args:
          summaries: `{tag: value}`: a number or 0-d array is a scalar, a string a text
            summary, any other array a histogram.
          step: the step to file them under; default the current step.

        Raises:
          RuntimeError: this process writes no summaries (not the chief, or no
            `summary_dir` / `checkpoint_dir`).
        """
        if self._summaries_closed:
            raise RuntimeError("summary_computed called on a closed session; write summaries before close().")
        if self.summary_dir is None:
            raise RuntimeError(
                "Writing a summary requires a summary writer: this session has none "
                f"(is_chief={self.is_chief}, summary_dir=None). Create the session with "
                "summary_dir= or checkpoint_dir= on the chief.")
        if not isinstance(summaries, Mapping) or not all(isinstance(tag, str) for tag in summaries):
            raise TypeError(f"summary_computed takes a dict {{tag: value}}; got {summaries!r:.80}.")
        writer = self._summary_writer()
        step = self.step if step is None else step
        scalars, texts, histograms = {}, {}, {}
        for tag, value in summaries.items():
            if isinstance(value, str):
                texts[tag] = value
                continue
            array = np.asarray(value)
            if array.ndim == 0:
                scalars[tag] = float(array)
            else:
                histograms[tag] = array
        if scalars:
            writer.write_scalars(step, scalars)
        if texts:
            writer.write_texts(step, texts)
        if histograms:
            writer.write_histograms(step, histograms)
        writer.flush()

    def _close(self, clean: bool) -> None:
        try:
            super()._close(clean)
        finally:
            self._summaries_closed = True
            handle, self._summary_handle = self._summary_handle, None
            if handle is not None:
                handle.close()


def _resolve(steps_name: str, steps: Any, secs_name: str, secs: Any, default: tuple[Any, Any]) -> tuple[Any, Any]:
    """TF's rules for a service's period: neither given → `default` (steps, secs);
    one given → the other off; 0 or None → off; both on → ValueError."""
    if steps is USE_DEFAULT and secs is USE_DEFAULT:
        return default
    steps = None if steps is USE_DEFAULT else steps
    secs = None if secs is USE_DEFAULT else secs
    if steps is not None:
        _errors.check_int(steps_name, steps, minimum=0)
    if secs is not None:
        _errors.check_number(secs_name, secs)
    if steps and secs:
        raise ValueError(
            f"Can not provide both every_secs and every_steps: got {steps_name}={steps!r} and "
            f"{secs_name}={secs!r}. Give one of them (and None, or leave it out, for the other).")
    return steps or None, secs or None

