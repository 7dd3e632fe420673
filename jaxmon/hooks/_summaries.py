"""SummarySaverHook and the summary kinds it writes (histograms, images, text)."""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np

from jaxmon._base import fetches as _fetches
from jaxmon._base.errors import check_on_error
from jaxmon._base.hook import RunArgs, RunContext, RunValues
from jaxmon._base.paths import by_path
from jaxmon._base.timed import TimedHook
from jaxmon._base.triggers import Trigger, timer_for
from jaxmon._metrics.reductions import Mean, Reduction, check_reduce
from jaxmon._ops import report_thread
from jaxmon._writers import WriterSlot


@dataclasses.dataclass(frozen=True)
class Histogram:
    """A histogram summary of a fetch (an output name or `fn(state, batch, outputs)`);
    a pytree (e.g. the parameters) gives one histogram per leaf, tagged by its path."""

    fetch: Any


@dataclasses.dataclass(frozen=True)
class Image:
    """An image summary of a fetch: HW, HWC or NHWC, floats in [0, 1] or uint8."""

    fetch: Any


@dataclasses.dataclass(frozen=True)
class Text:
    """A text summary: `format(value)` of a fetched value, on the host (e.g. decoding tokens)."""

    fetch: Any
    format: Callable[[Any], str] = str


_KINDS = {Histogram: "histograms", Image: "images", Text: "texts"}


class SummarySaverHook(TimedHook):
    """Writes summaries every N steps or seconds: every scalar output of the step, plus
    the extra summaries asked for (TF's `SummarySaverHook`).

    It writes after step 1 (the starting point), then after steps N, 2N, ... for
    `save_steps=N` (1, 8, 16, ... for 8), or every `save_secs` seconds. Values are read
    one run late, so writing never makes the device wait. With `reduce="mean"` (the
    default) each scalar is written as its mean over the steps since this hook's last
    write (steps 9 to 16 at step 16; steps 1 to 8 at step 8: the starting point's
    write does not end a window), accumulated on the device (see `jm.Mean`);
    `reduce="last"` writes its value at the write step, as TF. A reduction given as a
    summary (`jm.Ratio("loss_sum", "tokens")`, `jm.Mean(..., weight=)`, `.then(fn)`)
    covers the same steps. A checkpoint keeps the open window: a resumed run writes
    what the uninterrupted run would have.

    Args:
      save_steps, save_secs: the period; give exactly one.
      output_dir: a directory for TensorBoard event files and `metrics.jsonl` (shared
        with the other hooks writing there), or
      summary_writer: any `SummaryWriter`.
      summaries: extra summaries `{tag: spec}`; a spec is an output name, a callable
        `fn(state, batch, outputs)` (a pytree of scalars is tagged `tag/path`) or a
        `jm.Reduction` for scalars, or `jm.Histogram(fetch)`, `jm.Image(fetch)`,
        `jm.Text(fetch, format)` of the write step's value.
      reduce: "mean" (default) or "last", for scalars given by name or callable.
      hparams: hyper-parameters (a possibly nested dict), written once per run (not
        again when it resumes).
      output_scalars: write the step's scalar outputs (default True).
      on_error: "raise" (default) or "warn" (keep training if writing fails).

    Example:
      >>> import jaxmon as jm, numpy as np
      >>> hook = jm.SummarySaverHook(save_steps=100, output_dir="runs/example", summaries={
      ...     "train/ppl": jm.Ratio("loss_sum", "tokens").then(np.exp),
      ...     "params": jm.Histogram(lambda state, batch, outputs: state.params)})
    """

    def __init__(self, save_steps: int | None = None, save_secs: float | None = None,
                 output_dir: str | os.PathLike | None = None, summary_writer: Any = None,
                 summaries: Mapping[str, Any] | None = None, reduce: str = "mean", *,
                 hparams: Mapping[str, Any] | None = None, output_scalars: bool = True, on_error: str = "raise",
                 clock: Callable[[], float] = time.monotonic):
        self.timer = timer_for("SummarySaverHook", clock, first=True, save_steps=save_steps, save_secs=save_secs)
        self._slot = WriterSlot("SummarySaverHook", output_dir, summary_writer, required=True)
        if summaries is not None and not isinstance(summaries, Mapping):
            raise TypeError(f"SummarySaverHook summaries must be a dict {{tag: spec}}; got {summaries!r}.")
        if hparams is not None and not isinstance(hparams, Mapping):
            raise TypeError(f"SummarySaverHook hparams must be a dict; got {hparams!r}.")
        self.summaries = dict(summaries or {})
        self.reduce = check_reduce("SummarySaverHook", reduce)
        self._kinds = {tag: _KINDS.get(type(spec), "scalars") for tag, spec in self.summaries.items()}
        reduced = {tag: spec for tag, spec in self.summaries.items()
                   if isinstance(spec, Reduction) or (reduce == "mean" and self._kinds[tag] == "scalars")}
        self._fetches = _fetches.normalize(
            {tag: spec.fetch if isinstance(spec, tuple(_KINDS)) else spec for tag, spec in self.summaries.items()
             if tag not in reduced}, "SummarySaverHook summaries")
        self.hparams, self.output_scalars = hparams, output_scalars
        accumulators = {f"tag:{tag}": spec if isinstance(spec, Reduction) else Mean(spec)
                        for tag, spec in reduced.items()}
        if output_scalars and reduce == "mean":
            accumulators["outputs"] = Mean()
        if accumulators:
            self.accumulators = accumulators
        self.on_error = check_on_error("SummarySaverHook", on_error)

    def next_trigger(self, step: int) -> Trigger | None:
        return self.timer.next_trigger(step)

    def begin(self) -> None:
        self.timer.reset()
        self._slot.open()
        self._hparams_written = False

    def after_create_session(self, session) -> None:
        self._slot.restarted(session)
        self.timer.start(session.step)
        if self.hparams and session.restored_step is None and not self._hparams_written:
            self._slot.writer.write_hparams(self.hparams)  # once per run: a resumed run wrote them when it began
            self._hparams_written = True

    def before_run(self, ctx: RunContext) -> RunArgs | None:
        restart = not self.timer.opening(ctx.next_step)  # the record after step 1: the next one's mean covers it
        if not self.timer.due(ctx.next_step):
            return None
        return RunArgs(fetches=dict(self._fetches or {}), late=True, read=bool(self.accumulators), restart=restart)

    @report_thread.reports  # on the report thread: the loop only queues it
    def after_run(self, ctx: RunContext, values: RunValues) -> None:
        if values.results is None:
            return
        groups: dict[str, dict[str, Any]] = {"scalars": {}, "histograms": {}, "images": {}, "texts": {}}
        accumulated = values.accumulated or {}
        if "outputs" in accumulated:
            groups["scalars"].update(accumulated["outputs"])
        elif self.output_scalars:
            scalars = {tag: value for tag, value in _fetches.paths(values.outputs).items() if np.ndim(value) == 0}
            groups["scalars"].update(jax.device_get(scalars))
        reduced = {name[len("tag:"):]: value for name, value in accumulated.items() if name.startswith("tag:")}
        for tag, value in {**values.results, **reduced}.items():
            kind = self._kinds[tag]
            if kind == "texts":
                groups[kind][tag] = self.summaries[tag].format(value)
            elif kind == "images":
                groups[kind][tag] = value
            else:
                groups[kind].update(by_path(tag, value))
        bad = {tag: np.shape(v) for tag, v in groups["scalars"].items() if np.size(v) != 1}
        if bad:
            raise ValueError(f"SummarySaverHook: scalar summaries must be single values; got shapes {bad}. "
                             "Wrap array summaries in jm.Histogram(...) or jm.Image(...).")
        writer = self._slot.writer
        for kind, group in groups.items():
            if group:
                getattr(writer, f"write_{kind}")(values.step, group)

    def end(self, session) -> None:
        if self._slot.writer is not None:
            self._slot.writer.flush()

    def close(self) -> None:
        self._slot.close()

    def __repr__(self) -> str:
        return f"SummarySaverHook({self.timer!r}, tags={sorted(self.summaries)})"
