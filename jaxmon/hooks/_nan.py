"""NanHook: stop training when the loss is NaN or infinite, checked on the device."""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable
from typing import Any

from jaxmon._base import errors as _errors
from jaxmon._base.errors import NanLossDuringTrainingError, RollbackError
from jaxmon._base.hook import RunArgs, RunContext
from jaxmon._base.timed import TimedHook
from jaxmon._base.triggers import Trigger, timer_for
from jaxmon._checkpoints.manager import complete_steps
from jaxmon._metrics.reductions import FirstNonFinite
from jaxmon._writers.slot import WriterSlot

logger = logging.getLogger("jaxmon")

class NanHook(TimedHook):
    """Stops training when the loss is NaN or infinite (TF's `NanTensorHook`), or rolls
    back to the newest checkpoint past the batches that caused it.

    The check runs inside the compiled step, on every step (each step of a multi-step
    run too), and keeps the first bad step and its value on the device: it costs no
    host read of its own between reads. The hook acts at the next read of the
    accumulators: any hook's, its own every `every_n_steps` steps, a checkpoint save
    (which therefore never holds the state of that step or a later one),
    `sess.sync()` and `close()`. The error names the exact first bad step.

    Args:
      fetch: the loss: an output name or a callable `fn(state, batch, outputs)`;
        arrays and pytrees are checked element-wise.
      fail_on_nan_loss: raise `NanLossDuringTrainingError` (default), or log a warning
        and stop the loop cleanly (the state is then never saved).
      every_n_steps: read the check at least this often (a read is one small
        asynchronous copy, delivered a run late): the most steps the hook may act
        after the bad step when nothing else reads.
      skip_updates: 0 (default) keeps every update. n > 0 keeps the state of the step
        before a bad loss instead (a `jnp.where` on the device, no host sync), up to
        n consecutive steps; the (n + 1)-th bad step in a row is then reported.
        Skipped steps still count as steps (their outputs reach the other hooks'
        window means) and are logged at reads.
      on_nan: what a reported bad step does: "raise" or "stop" (the default follows
        `fail_on_nan_loss`), or "rollback": restore the newest complete checkpoint,
        move the data past the batches from it through the bad step (the log names
        their positions), and go on; after `max_rollbacks` roll-backs, raise. Needs
        a checkpoint directory. With several JAX processes, every process rolls back
        together.
      max_rollbacks: the most roll-backs in one session (0: raise as "raise" does).
      spike_factor: a finite loss above this factor times its running average is a
        bad step too (a loss spike; judged on the device, see `jm.FirstNonFinite`);
        until `spike_warmup` good steps have made the average, above this factor times
        the first good loss (a run that diverges from its first steps); None: no spike
        rule.
      output_dir, summary_writer: where the counts go (`nan/nan_steps`,
        `nan/inf_steps`, `nan/spike_steps`, `nan/rollbacks`, `nan/skipped_batches`,
        written when they change); with neither, they are only logged.

    Example:
      >>> import jaxmon as jm
      >>> hook = jm.NanHook("loss", fail_on_nan_loss=False, every_n_steps=50)
      >>> guard = jm.NanHook("loss", on_nan="rollback", max_rollbacks=3, spike_factor=10.0)
    """

    def __init__(self, fetch: Any = "loss", fail_on_nan_loss: bool = True, every_n_steps: int = 100, *,
                 skip_updates: int = 0, on_nan: str | None = None, max_rollbacks: int = 3,
                 spike_factor: float | None = None, spike_warmup: int = 20,
                 output_dir: str | os.PathLike | None = None, summary_writer: Any = None,
                 clock: Callable[[], float] = time.monotonic):
        _errors.check_int("NanHook skip_updates", skip_updates)
        _errors.check_int("NanHook max_rollbacks", max_rollbacks)
        _errors.check_int("NanHook spike_warmup", spike_warmup)
        if on_nan not in (None, "raise", "stop", "rollback"):
            raise ValueError(f"NanHook on_nan must be 'raise', 'stop' or 'rollback'; got {on_nan!r}.")
        self.timer = timer_for("NanHook", clock, every_n_steps=every_n_steps, every_n_secs=None)
        self.accumulators = {"first": FirstNonFinite(fetch, max_skips=skip_updates, spike_factor=spike_factor,
                                                     spike_warmup=spike_warmup)}
        self.on_nan = on_nan or ("raise" if fail_on_nan_loss else "stop")
        self.fetch, self.fail_on_nan_loss, self.skip_updates = fetch, self.on_nan != "stop", skip_updates
        self.max_rollbacks, self.spike_factor = max_rollbacks, spike_factor
        self._slot = WriterSlot("NanHook", output_dir, summary_writer, required=False)
        self._session: Any = None
        self._done = False  # after a clean stop, later reads need no second warning
        self._skipped = 0
        self._counts = dict.fromkeys(_COUNTS, 0)
        self._rolled_back: int | None = None  # the bad step of a roll-back under way

    def begin(self) -> None:
        self.timer.reset()
        self._done, self._skipped, self._counts = False, 0, dict.fromkeys(_COUNTS, 0)
        self._slot.open()

    def after_create_session(self, session) -> None:
        self._session = session
        if self.on_nan == "rollback" and session.checkpoint_dir is None:
            raise ValueError("NanHook(on_nan='rollback') goes back to the newest checkpoint, but the session has "
                             "no checkpoint_dir; give it one (MonitoredTrainingSession(checkpoint_dir=...)).")
        if session.restored_step is None:  # a fresh state: its count of skips starts at 0 too
            self._skipped = 0
        self._slot.restarted(session)
        if self._rolled_back is not None:
            self._done, bad, self._rolled_back = False, self._rolled_back, None
            if session.restored_step is not None:
                self._counts["skipped_batches"] += max(0, bad - session.restored_step)
            self._write(session.step)

    def get_state(self) -> dict[str, Any]:  # the checkpoint keeps the counts too
        return {**super().get_state(), "skipped": self._skipped, "counts": dict(self._counts)}

    def set_state(self, state: dict[str, Any]) -> None:
        super().set_state(state)
        self._skipped = state.get("skipped", 0)
        self._counts = {**dict.fromkeys(_COUNTS, 0), **state.get("counts", {})}

    def next_trigger(self, step: int) -> Trigger | None:
        return self.timer.next_trigger(step, exact=False)  # a read a few steps later is as good

    def before_run(self, ctx: RunContext) -> RunArgs | None:
        return RunArgs(read=True, late=True) if self.timer.due(ctx.next_step) else None

    def after_read(self, step: int, values: dict[str, Any]) -> None:
        first = values["first"]
        if first["skipped"] > self._skipped:
            logger.warning("NanHook skipped %d update(s) with a bad %r by step %d (%d in all).",
                           first["skipped"] - self._skipped, self.fetch, step, first["skipped"])
            self._skipped = first["skipped"]
        if first["step"] is None or self._done:
            return
        kind = "Spike in the" if first.get("spike") else _kind(first["value"])
        value = f"{first['value']:.6g}" if isinstance(first["value"], float) else first["value"]
        where = f"{self.fetch!r} = {value} at step {first['step']}"
        self._counts["spike_steps" if first.get("spike") else "nan_steps" if kind == "NaN" else "inf_steps"] += 1
        self._done = True
        if self._session is not None:  # never saved, even by a close() after the error was caught
            self._session.reject_state(f"NanHook saw {where}")
        rollbacks, checkpointed = self._counts["rollbacks"], True
        if self.on_nan == "rollback" and rollbacks < self.max_rollbacks and (checkpointed := self._can_roll_back()):
            self._counts["rollbacks"] += 1
            self._rolled_back = first["step"]
            self._write(step)
            logger.error("%s loss during training: %s (seen at step %d); rolling back to the newest checkpoint "
                         "(roll-back %d of at most %d).", kind, where, step, rollbacks + 1, self.max_rollbacks)
            raise RollbackError(f"{kind} loss during training: {where}; rolling back to the newest checkpoint.",
                                step=first["step"], value=first["value"])
        self._write(step)
        if self.on_nan != "stop":
            logger.error("Model diverged: %s (seen at step %d).", where, step)
            if self.on_nan != "rollback":
                more = ("; NanHook(fail_on_nan_loss=False) stops cleanly instead, and NanHook(on_nan='rollback') "
                        "goes back to the newest checkpoint past that batch")
            elif not checkpointed:
                more = ("; NanHook(on_nan='rollback') found no complete checkpoint to go back to: save one early "
                        "(the saver saves step 0 at creation unless it starts from a restored checkpoint)")
            else:
                more = (f", after {rollbacks} roll-back(s), the most max_rollbacks={self.max_rollbacks} allows: "
                        "raise max_rollbacks if the data has more bad batches")
            raise NanLossDuringTrainingError(
                f"{kind} loss during training: {where}. Lower the learning rate, clip gradients, or check the data "
                f"of that step{more}.", step=first["step"], value=first["value"])
        logger.warning("%s loss during training: %s; stopping at step %d.", kind, where, step)
        if self._session is not None:
            self._session.request_stop()

    def _can_roll_back(self) -> bool:
        directory = None if self._session is None else self._session.checkpoint_dir
        if directory is not None and complete_steps(directory):
            return True
        logger.error("NanHook(on_nan='rollback'): no complete checkpoint in %s to roll back to.", directory)
        return False

    def _write(self, step: int) -> None:
        """The counts, as summaries (when the hook has a writer)."""
        if self._slot.writer is not None:
            self._slot.writer.write_scalars(step, {f"nan/{name}": float(n) for name, n in self._counts.items()})

    def close(self) -> None:
        self._slot.close()

    def __repr__(self) -> str:
        return f"NanHook({self.fetch!r}, on_nan={self.on_nan!r})"


#: The counts a `NanHook` keeps, in its checkpointed state and its summaries.
_COUNTS = ("nan_steps", "inf_steps", "spike_steps", "rollbacks", "skipped_batches")


def _kind(value: Any) -> str:
    """The word for a loss `value`: "NaN" for NaN, "Non-finite" for an infinity or for an
    array's count of non-finite entries (NaN and infinities alike)."""
    return "NaN" if isinstance(value, float) and math.isnan(value) else "Non-finite"


NanTensorHook = NanHook
