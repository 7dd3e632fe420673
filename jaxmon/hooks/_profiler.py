"""ProfilerHook: a `jax.profiler` trace of one step every N steps or seconds."""

from __future__ import annotations

import logging
import os
import shutil
import time
from collections.abc import Callable

import jax

from jaxmon._base.errors import check_on_error
from jaxmon._base.hook import RunContext, RunValues
from jaxmon._base.timed import TimedHook
from jaxmon._base.triggers import Trigger, timer_for

logger = logging.getLogger("jaxmon")


class ProfilerHook(TimedHook):
    """Traces one step every N steps or seconds with `jax.profiler`, never the first.

    Each trace goes to `output_dir/plugins/profile/step_<N>/`, the layout TensorBoard's
    profile plugin reads (`tensorboard --logdir output_dir`); a Chrome trace
    (`*.trace.json.gz`) sits beside it. The traced step is waited for, so that the
    trace holds its device work; other steps are untouched.

    Args:
      save_steps, save_secs: the period; give exactly one.
      output_dir: where traces go.
      on_error: "raise" (default) or "warn" (keep training if tracing fails).

    Example:
      >>> import jaxmon as jm
      >>> hook = jm.ProfilerHook(save_steps=1000, output_dir="runs/example")
    """

    def __init__(self, save_steps: int | None = None, save_secs: float | None = None,
                 output_dir: str | os.PathLike = "", *, on_error: str = "raise",
                 clock: Callable[[], float] = time.monotonic):
        self.timer = timer_for("ProfilerHook", clock, save_steps=save_steps, save_secs=save_secs)
        if not output_dir:
            raise ValueError("ProfilerHook needs output_dir= (a directory for the traces).")
        self.output_dir = os.fspath(output_dir)
        self.on_error = check_on_error("ProfilerHook", on_error)
        self._start: int | None = None
        self._tracing: int | None = None
        self.traced_steps: list[int] = []

    def next_trigger(self, step: int) -> Trigger | None:
        return self.timer.next_trigger(step)

    def begin(self) -> None:
        self._tracing = None
        self.timer.reset()

    def after_create_session(self, session) -> None:
        if self._tracing is not None:  # a recovery interrupted the traced run
            self._stop(self._tracing)
        self._start = session.step
        self.timer.start(session.step)

    def before_run(self, ctx: RunContext) -> None:
        step = ctx.next_step
        if not self.timer.should_trigger_for_step(step):
            return
        if ctx.step == self._start:  # the session's first run compiles the step: not traced
            self.timer.update_last_triggered_step(step)
        else:
            os.makedirs(self.output_dir, exist_ok=True)
            jax.profiler.start_trace(self.output_dir)
            self._tracing = step

    def after_run(self, ctx: RunContext, values: RunValues) -> None:
        if self._tracing is None:
            return
        jax.block_until_ready(ctx.session.state)
        self._stop(values.step)
        self.timer.update_last_triggered_step(values.step)

    def _stop(self, step: int) -> None:
        self._tracing = None
        jax.profiler.stop_trace()
        profile = os.path.join(self.output_dir, "plugins", "profile")
        runs = [name for name in os.listdir(profile) if not name.startswith("step_")]
        newest = max(runs, key=lambda name: os.path.getmtime(os.path.join(profile, name)))
        target = os.path.join(profile, f"step_{step}")
        shutil.rmtree(target, ignore_errors=True)
        os.rename(os.path.join(profile, newest), target)
        self.traced_steps.append(step)
        logger.info("Profiler trace of step %d written to %s", step, target)

    def close(self) -> None:
        if self._tracing is not None:  # an error ended the traced run: keep what was traced
            self._stop(self._tracing)

    def __repr__(self) -> str:
        return f"ProfilerHook({self.timer!r}, output_dir={self.output_dir!r})"
