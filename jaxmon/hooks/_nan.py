"""NanHook: stop training when the loss is NaN or infinite."""

from __future__ import annotations

import logging
import math
from typing import Any

import numpy as np

from jaxmon import _fetches
from jaxmon._errors import NanLossDuringTrainingError
from jaxmon._hook import Hook, RunArgs, RunContext, RunValues

logger = logging.getLogger("jaxmon")


class NanHook(Hook):
    """Stops training when the loss is NaN or infinite (TF's `NanTensorHook`).

    The check never makes the device wait: the loss is read one step late (see
    `RunArgs.late`), so the hook acts in the run *after* the non-finite step, or at
    `sess.sync()` or `close()` if that step was the last. The error names the
    non-finite step and its value.

    Args:
      fetch: the loss: an output name (read from the outputs, nothing recompiles) or a
        callable `fn(state, batch, outputs)`. Arrays are checked element-wise.
      fail_on_nan_loss: raise `NanLossDuringTrainingError` (default), or log a warning
        and stop the loop cleanly.

    Example:
      >>> import jaxmon as jm
      >>> hook = jm.NanHook("loss", fail_on_nan_loss=False)
    """

    def __init__(self, fetch: Any = "loss", fail_on_nan_loss: bool = True):
        _fetches.normalize({"value": fetch}, "NanHook fetch")
        self.fetch, self.fail_on_nan_loss = fetch, fail_on_nan_loss
        # An output name is read from the outputs as they are: nothing to fetch, per step
        # the hook costs one late call and one read of a finished array.
        self._args = RunArgs(late=True) if isinstance(fetch, str) else RunArgs({"value": fetch}, late=True)
        self._stopped = False  # after a clean stop, the runs already queued need no second warning

    def begin(self) -> None:
        self._stopped = False

    def before_run(self, ctx: RunContext) -> RunArgs:
        return self._args

    def after_run(self, ctx: RunContext, values: RunValues) -> None:
        if self._stopped:
            return
        if isinstance(self.fetch, str):
            if self.fetch not in values.outputs:
                raise ValueError(f"NanHook checks {self.fetch!r}, which is not an output of the step function; "
                                 f"its outputs are {sorted(values.outputs)}. Pass NanHook(fetch=<the loss's name>).")
            value = np.asarray(values.outputs[self.fetch])
        else:
            value = np.asarray(values.results["value"])
        if value.ndim == 0 and math.isfinite(value):
            return
        finite = np.isfinite(value)
        if finite.all():
            return
        bad = value.size - int(finite.sum())
        shown = value.item() if value.size == 1 else f"{bad} of {value.size} entries non-finite"
        where = f"{self.fetch!r} = {shown} at step {values.step}"
        if self.fail_on_nan_loss:
            logger.error("Model diverged with loss = NaN: %s.", where)
            raise NanLossDuringTrainingError(
                f"NaN loss during training: {where}. Lower the learning rate, clip gradients, or check "
                "the data of that step; NanHook(fail_on_nan_loss=False) stops cleanly instead.",
                step=values.step, value=shown)
        logger.warning("NaN loss during training: %s; stopping.", where)
        self._stopped = True
        ctx.session.reject_state(f"NanHook saw {where}")
        ctx.request_stop()

    def __repr__(self) -> str:
        return f"NanHook({self.fetch!r}, fail_on_nan_loss={self.fail_on_nan_loss})"


NanTensorHook = NanHook
