"""NanHook: stop training when the loss is NaN or infinite, checked on the device."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from typing import Any

from jaxmon import _errors
from jaxmon._errors import NanLossDuringTrainingError
from jaxmon._hook import RunArgs, RunContext
from jaxmon._reductions import FirstNonFinite
from jaxmon._triggers import Trigger, timer_for
from jaxmon.hooks._timed import TimedHook

logger = logging.getLogger("jaxmon")


class NanHook(TimedHook):
    """Stops training when the loss is NaN or infinite (TF's `NanTensorHook`).

    The check runs inside the compiled step, on every step (each step of a multi-step
    run too), and keeps the first non-finite step and its value on the device: it
    costs no host read of its own between reads. The hook acts at the next read of
    the accumulators: any hook's, its own every `every_n_steps` steps, a checkpoint
    save (which therefore never holds the state of that step or a later one),
    `sess.sync()` and `close()`. The error names the exact first non-finite step.

    Args:
      fetch: the loss: an output name or a callable `fn(state, batch, outputs)`;
        arrays and pytrees are checked element-wise.
      fail_on_nan_loss: raise `NanLossDuringTrainingError` (default), or log a warning
        and stop the loop cleanly (the state is then never saved).
      every_n_steps: read the check at least this often (a read is one small
        asynchronous copy, delivered a run late): the most steps the hook may act
        after the non-finite step when nothing else reads.
      skip_updates: 0 (default) keeps every update. n > 0 keeps the state of the step
        before a non-finite loss instead (a `jnp.where` on the device, no host
        sync), up to n consecutive steps; the (n + 1)-th non-finite step in a row is
        then reported. Skipped steps still count as steps (their outputs reach the
        other hooks' window means) and are logged at reads.

    Example:
      >>> import jaxmon as jm
      >>> hook = jm.NanHook("loss", fail_on_nan_loss=False, every_n_steps=50)
    """


    def __init__(self, fetch: Any = "loss", fail_on_nan_loss: bool = True, every_n_steps: int = 100, *,
                 skip_updates: int = 0, clock: Callable[[], float] = time.monotonic):
        _errors.check_int("NanHook skip_updates", skip_updates)
        self.timer = timer_for("NanHook", clock, every_n_steps=every_n_steps, every_n_secs=None)
        self.accumulators = {"first": FirstNonFinite(fetch, max_skips=skip_updates)}
        self.fetch, self.fail_on_nan_loss, self.skip_updates = fetch, fail_on_nan_loss, skip_updates
        self._session: Any = None
        self._done = False  # after a clean stop, later reads need no second warning
        self._skipped = 0

    def begin(self) -> None:
        self.timer.reset()
        self._done, self._skipped = False, 0

    def after_create_session(self, session) -> None:
        self._session = session
        if session.restored_step is None:  # a fresh state: its count of skips starts at 0 too
            self._skipped = 0

    def get_state(self) -> dict[str, Any]:
        return {**super().get_state(), "skipped": self._skipped}  # the checkpoint keeps the count too

    def set_state(self, state: dict[str, Any]) -> None:
        super().set_state(state)
        self._skipped = state.get("skipped", 0)

    def next_trigger(self, step: int) -> Trigger | None:
        return self.timer.next_trigger(step, exact=False)  # a read a few steps later is as good

    def before_run(self, ctx: RunContext) -> RunArgs | None:
        return RunArgs(read=True, late=True) if self.timer.due(ctx.next_step) else None

    def after_read(self, step: int, values: dict[str, Any]) -> None:
        first = values["first"]
        if first["skipped"] > self._skipped:
            logger.warning("NanHook skipped %d update(s) with a non-finite %r by step %d (%d in all).",
                           first["skipped"] - self._skipped, self.fetch, step, first["skipped"])
            self._skipped = first["skipped"]
        if first["step"] is None or self._done:
            return
        where = f"{self.fetch!r} = {first['value']} at step {first['step']}"
        kind = _kind(first["value"])
        self._done = True
        if self._session is not None:  # never saved, even by a close() after the error was caught
            self._session.reject_state(f"NanHook saw {where}")
        if self.fail_on_nan_loss:
            logger.error("Model diverged: %s (seen at step %d).", where, step)
            raise NanLossDuringTrainingError(
                f"{kind} loss during training: {where}. Lower the learning rate, clip gradients, or check "
                "the data of that step; NanHook(fail_on_nan_loss=False) stops cleanly instead.",
                step=first["step"], value=first["value"])
        logger.warning("%s loss during training: %s; stopping at step %d.", kind, where, step)
        if self._session is not None:
            self._session.request_stop()

    def __repr__(self) -> str:
        return f"NanHook({self.fetch!r}, fail_on_nan_loss={self.fail_on_nan_loss})"


def _kind(value: Any) -> str:
    """The word for a loss `value`: "NaN" for NaN, "Non-finite" for an infinity or for an
    array's count of non-finite entries (NaN and infinities alike)."""
    return "NaN" if isinstance(value, float) and math.isnan(value) else "Non-finite"


NanTensorHook = NanHook
