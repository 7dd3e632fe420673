"""EvalHook: evaluation on validation data during training."""

from __future__ import annotations

import collections.abc
import logging
import os
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxmon._base.errors import check_on_error
from jaxmon._base.hook import RunArgs, RunContext, RunValues
from jaxmon._base.timed import TimedHook
from jaxmon._base.triggers import Trigger, timer_for
from jaxmon._metrics.reductions import Reduction
from jaxmon._run.compiled_step import trace_once
from jaxmon._writers import WriterSlot
from jaxmon.hooks._logging import show_info_logs

logger = logging.getLogger("jaxmon")


class EvalHook(TimedHook):
    """Evaluates the state on validation data every N steps or seconds, and at the end.

    `eval_fn(state, batch) -> {name: value}` is jitted once; each evaluation runs it over
    every batch of `data`. A metric listed in `metrics` is reduced over the whole
    evaluation set on the device (`jm.Ratio("loss_sum", "tokens")` is Σ/Σ over every
    batch, not a mean of batch ratios); every other output (a per-batch mean) is
    averaged weighted by batch size (the leading dimension of the batch's arrays) on
    the host in float64, but for those a metric reads (the sums a ratio divides), which
    are not reported (give one its own metric, `jm.Sum("tokens")`, to have it). The
    results are written as summaries `<prefix>/<name>` and logged. Give equal-sized
    batches (pad and mask the last) to compile once;
    `trace_count` says how often it compiled. It evaluates after steps N, 2N, ... for
    `every_n_steps=N` (a resumed run keeps the schedule), and with `at_start=True`
    the state the session starts from too. With `carry=`, `eval_fn(state, batch, carry)
    -> (outputs, carry)` is given what it returned for the batch before (a recurrent
    model's state across the split's batches), `carry` itself for the first.

    Args:
      eval_fn: `eval_fn(state, batch) -> dict of scalars`, pure and jittable.
      data: the validation batches, read in full at each evaluation: a list (or any
        re-iterable collection), or a function returning a fresh iterable.
      every_n_steps, every_n_secs: the period; give exactly one, or neither with
        `at_end=True` to evaluate only at the end.
      summary_writer, output_dir: where summaries go (shared with the other hooks writing
        to that directory); with neither, where a `MonitoredTrainingSession` writes its
        own (its `summary_dir`, on the chief), else nowhere.
      metrics: `{name: jm.Reduction}` over `eval_fn`'s outputs (by name, or a callable
        `fn(state, batch, outputs)`), reduced over every evaluation batch.
      prefix: tag prefix of the summaries.
      at_start: also evaluate the state the session starts from (step 0, or the
        restored step unless it was evaluated already).
      at_end: also evaluate at `end`, unless the last step was just evaluated.
      carry: the first batch's carry (a pytree), for an `eval_fn` that takes one.
      on_error: "raise" (default) or "warn".

    Attributes:
      latest: the last evaluation's metrics (floats), or None.
      history: every evaluation as `(step, metrics)`.

    Example:
      >>> import jaxmon as jm
      >>> def eval_fn(state, batch):
      ...     error = state * batch["x"] - batch["y"]
      ...     return {"loss_sum": (error ** 2).sum(), "count": error.size}
      >>> hook = jm.EvalHook(eval_fn, data=[{"x": [1.0], "y": [2.0]}], every_n_steps=1000,
      ...                    metrics={"loss": jm.Ratio("loss_sum", "count")})
    """

    time_category = "evaluation"  # where its time goes in the session's goodput (`jm.GoodputHook`)

    def __init__(self, eval_fn: Callable[[Any, Any], dict[str, Any]], data: Iterable[Any] | Callable[[], Iterable],
                 every_n_steps: int | None = None, every_n_secs: float | None = None, summary_writer: Any = None,
                 *, output_dir: str | os.PathLike | None = None, metrics: Mapping[str, Reduction] | None = None,
                 prefix: str = "eval", at_start: bool = False, at_end: bool = True, carry: Any = None,
                 on_error: str = "raise", clock: Callable[[], float] = time.monotonic):
        if not callable(eval_fn):
            raise TypeError(f"EvalHook eval_fn must be a function eval_fn(state, batch) -> dict; got {eval_fn!r}.")
        if isinstance(data, collections.abc.Iterator) or not (callable(data) or isinstance(data, Iterable)):
            raise ValueError(f"EvalHook reads data again at every evaluation, so it needs a list of batches (or "
                             f"another re-iterable collection) or a function returning a fresh iterable; got "
                             f"{type(data).__name__}, which can be read only once.")
        metrics = dict(metrics or {})
        bad = {name: spec for name, spec in metrics.items() if not isinstance(spec, Reduction)}
        if bad:
            raise TypeError(f"EvalHook metrics must be {{name: jm.Reduction}}, e.g. {{'loss': jm.Ratio('loss_sum', "
                            f"'tokens')}}; got {bad!r}.")
        self.timer = timer_for("EvalHook", clock, at_end=at_end, every_n_steps=every_n_steps,
                               every_n_secs=every_n_secs)
        self._slot = WriterSlot("EvalHook", output_dir, summary_writer, required=False, follows_session=True)
        self.eval_fn, self.data, self.prefix, self.at_end, self.at_start = eval_fn, data, prefix, at_end, at_start
        self.metrics, self.carry = metrics, carry
        self.on_error = check_on_error("EvalHook", on_error)
        self.trace_count = 0
        self._eval_fn = trace_once(eval_fn)  # one trace for the accumulators' shapes and the program
        self._jitted = jax.jit(self._traced)
        self._inits: list[Any] | None = None
        self.latest: dict[str, float] | None = None
        self.history: list[tuple[int, dict[str, float]]] = []

    def _traced(self, state: Any, batch: Any, accs: list[Any], carry: Any) -> Any:
        self.trace_count += 1
        outputs, carry = self._outputs(state, batch, carry)
        accs = [reduction.update(acc, reduction.value(state, batch, outputs), jnp.int32(0))
                for reduction, acc in zip(self.metrics.values(), accs, strict=True)]
        return outputs, accs, carry

    def _outputs(self, state: Any, batch: Any, carry: Any) -> tuple[Any, Any]:
        """`eval_fn`'s outputs for `batch`, and the carry for the next one (None without `carry=`)."""
        if self.carry is None:
            return self._eval_fn(state, batch), None
        return self._eval_fn(state, batch, carry)

    def begin(self) -> None:
        show_info_logs()
        self._slot.open()
        self.timer.reset()

    def after_create_session(self, session) -> None:
        self._slot.restarted(session)
        self.timer.start(session.step)
        if self.at_start and all(step != session.step for step, _ in self.history):
            self.evaluate(session)

    def get_state(self) -> dict[str, Any]:
        return {**super().get_state(), "history": [[step, metrics] for step, metrics in self.history]}

    def set_state(self, state: dict[str, Any]) -> None:
        super().set_state(state)
        self.history = [(step, metrics) for step, metrics in state["history"]]
        self.latest = self.history[-1][1] if self.history else None

    def next_trigger(self, step: int) -> Trigger | None:
        return self.timer.next_trigger(step)

    def before_run(self, ctx: RunContext) -> RunArgs | None:
        # The accumulators read at this run, and every hook's `after_read` delivered before
        # `after_run` (not late): a NanHook that finds the state bad acts before it is evaluated.
        return RunArgs(read=True) if self.timer.should_trigger_for_step(ctx.next_step) else None

    def after_run(self, ctx: RunContext, values: RunValues) -> None:
        if self.timer.due(values.step):
            self.evaluate(ctx.session)

    def end(self, session) -> None:
        # A preemption's stop is no end of the run: the resumed run evaluates where it would.
        if session.preemption_requested:
            return
        if self.at_end and (not self.history or self.history[-1][0] != session.step):
            self.evaluate(session)

    def evaluate(self, session) -> dict[str, float]:
        """Evaluates the session's current state now; returns the metrics."""
        batches = self.data() if callable(self.data) else self.data
        results, weights, accs, carry = [], [], None, self.carry
        for batch in batches:
            if accs is None:
                accs = self._start_metrics(session.state, batch)
            outputs, accs, carry = self._jitted(session.state, batch, accs, carry)
            results.append(outputs)
            weights.append(_weight(batch))
        if not results:
            raise ValueError("EvalHook data gave no batches; pass a non-empty list of validation batches.")
        results, accs = jax.device_get((results, accs))
        shapes = {name: np.shape(value) for name, value in results[0].items() if np.size(value) != 1}
        if shapes:
            raise ValueError(f"EvalHook eval_fn must return a dict of scalars (per-batch means); got shapes {shapes}. "
                             "Reduce each metric over the batch, e.g. with .mean(), or give a jm.Reduction in "
                             "metrics=.")
        total = sum(weights)
        means = {name: float(sum(np.float64(r[name]) * w for r, w in zip(results, weights, strict=True)) / total)
                 for name in results[0]}
        for name in set().union(*(reduction.reads() for reduction in self.metrics.values())):
            means.pop(name, None)  # a metric's parts: not means of their own
        for (name, reduction), acc in zip(self.metrics.items(), accs, strict=True):
            means[name] = float(np.asarray(reduction.result(acc, len(results))))
        self.latest = means
        self.history.append((session.step, means))
        logger.info("%s at step %d: %s", self.prefix, session.step,
                    ", ".join(f"{name} = {value:.6g}" for name, value in sorted(means.items())))
        if self._slot.writer is not None:
            self._slot.writer.write_scalars(session.step, {f"{self.prefix}/{k}": v for k, v in means.items()})
        return means

    def _start_metrics(self, state: Any, batch: Any) -> list[Any]:
        """The metrics' accumulators before the first batch (their shapes from one trace)."""
        if self._inits is None:
            def values(state, batch, carry):
                outputs, _ = self._outputs(state, batch, carry)
                return [reduction.value(state, batch, outputs) for reduction in self.metrics.values()]

            shapes = jax.eval_shape(values, state, batch, self.carry)
            self._inits = [reduction.init(shape) for reduction, shape in zip(self.metrics.values(), shapes,
                                                                            strict=True)]
        return self._inits

    def close(self) -> None:
        self._slot.close()

    def __repr__(self) -> str:
        return f"EvalHook({getattr(self.eval_fn, '__qualname__', self.eval_fn)!r}, {self.timer!r})"


def _weight(batch: Any) -> int:
    sizes = {np.shape(leaf)[0] for leaf in jax.tree.leaves(batch) if np.ndim(leaf)}
    return sizes.pop() if len(sizes) == 1 else 1
