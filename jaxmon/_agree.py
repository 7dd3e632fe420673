"""Decisions that every JAX process takes at the same step.

With several processes, each step is one SPMD program: if one process stopped, saved
or wrote at a step where another did not, the collectives of the two would no longer
match and both would hang. So, after every run, the processes exchange a few numbers
(one all-gather of a small vector) and act on them together: a stop that one of them
requested, the end of its data, an error it raised, and the chief's clock, which every
seconds-based trigger then reads, so that "every 600 seconds" fires at one step on all.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import jax
import numpy as np
from jax.experimental import multihost_utils

logger = logging.getLogger("jaxmon")

_MESSAGE_BYTES = 512


class PeerError(RuntimeError):
    """Another JAX process of this run failed, or stopped answering; every process
    raises it (the failing one raises its own error) at the same step."""


class Decision(NamedTuple):
    stop: bool  # a process asked to stop (or its data ended): every process stops now
    stopped_by: tuple[int, ...]
    failure: tuple[int, str] | None  # (process, error) of the first process that failed


class Agreement:
    """One all-gather per run of `[stop, failed, chief's clock]` across processes."""

    def __init__(self, clock: Any = time.monotonic):
        self.process_index, self.process_count = jax.process_index(), jax.process_count()
        self._clock = clock
        self.time = clock()  # the chief's clock at the last agreement
        self.rounds = 0

    def clock(self) -> float:
        """The agreed time: the chief's clock at the last agreement (the same number on
        every process until the next one)."""
        return self.time

    def __call__(self, step: int, *, stop: bool, error: BaseException | None) -> Decision:
        chief_time = self._clock() if self.process_index == 0 else 0.0
        flags = np.array([float(stop), float(error is not None), chief_time], np.float64)
        everyone = _gather(flags, step)
        self.rounds += 1
        self.time = float(everyone[0, 2])
        failed = [int(i) for i in np.flatnonzero(everyone[:, 1])]
        failure = None
        if failed:
            text = "" if error is None else f"{type(error).__name__}: {error}"
            data = np.frombuffer(text.encode()[:_MESSAGE_BYTES].ljust(_MESSAGE_BYTES, b"\0"), np.uint8)
            messages = _gather(data, step)
            failure = (failed[0], bytes(messages[failed[0]]).rstrip(b"\0").decode(errors="replace"))
        stopped_by = tuple(int(i) for i in np.flatnonzero(everyone[:, 0]))
        return Decision(bool(stopped_by) or bool(failed), stopped_by, failure)

    def all(self, flag: bool, step: int) -> bool:
        """Whether `flag` is True on every process."""
        return bool(_gather(np.array([float(flag)]), step).all())

    def gather(self, value: Any, step: int) -> list[Any]:
        """Every process's `value` (JSON-serialisable): two all-gathers, its length, then its text."""
        text = json.dumps(value).encode()
        longest = int(_gather(np.array([len(text)], np.int64), step).max())
        padded = np.frombuffer(text.ljust(longest, b" "), np.uint8)
        return [json.loads(bytes(row)) for row in _gather(padded, step)]


class AgreedRuns:
    """A session's runs when several JAX processes share the step: after each, every
    process learns whether any of them asked to stop, ran out of data or failed in a
    hook, and all act on it at this same step. The next batch is taken before
    agreeing, so that the end of one process's data stops all of them.

    Args:
      batches: the session's `BatchSource`.
      hooks: the session's hooks: their timers read the agreed clock.
      step: the session's step number now.
      stop_asked: whether this process asked to stop.
    """

    def __init__(self, batches: Any, hooks: Iterable[Any], *, step: Callable[[], int], stop_asked: Callable[[], bool]):
        self._agreement = Agreement()
        self._batches, self._step, self._stop_asked = batches, step, stop_asked
        #: True once the processes agreed to stop.
        self.stopped = False
        #: True once another process stopped answering.
        self.peer_lost = False
        self._data_ended = False
        for hook in hooks:  # seconds-based triggers read the chief's clock, agreed each run
            if hook.timer is not None:
                hook.timer.use_clock(self._agreement.clock)

    def run(self, run_once: Callable[[Any], Any], batch: Any) -> Any:
        """`run_once(batch)` (None: the next batch of data), then the agreement."""
        from_data = batch is None and self._batches.has_data
        if from_data:
            batch = self._batches.next_one()
        before, error, result = self._step(), None, None
        try:
            result = run_once(batch)
        except Exception as raised:
            if self._step() == before:  # the step never ran here: the others wait in it for this process
                raise
            error = raised  # after the step (a hook's after_run, e.g. a NaN): raised once all agree
        if from_data and not self._batches.take_ahead():
            self._data_ended = True
        step = self._step()
        decision = self._agreed(self._agreement, step, stop=self._stop_asked() or self._data_ended, error=error)
        if decision.failure is not None:
            if error is not None:
                raise error
            process, message = decision.failure
            raise PeerError(f"JAX process {process} failed after step {step}: {message}. "
                            f"Every process of the run stops at this step.")
        if decision.stop and not self.stopped:
            self.stopped = True
            if len(decision.stopped_by) < self._agreement.process_count:  # not a stop all of them took
                logger.info("Process(es) %s asked to stop (or ran out of data) at step %d: every process "
                            "stops.", list(decision.stopped_by), step)
        return result

    def all(self, flag: bool) -> bool:
        """Whether `flag` holds on every process (every process calls it at one point)."""
        return self._agreed(self._agreement.all, bool(flag), self._step())

    def gather(self, value: Any) -> list[Any]:
        """Every process's `value` (JSON), in process order (every process calls it at one point)."""
        return self._agreed(self._agreement.gather, value, self._step())

    def _agreed(self, agree: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        try:
            return agree(*args, **kwargs)
        except PeerError as lost:
            # Say so now: JAX may abort this process at its shutdown barrier before a
            # traceback is printed. Checkpoint savers stop waiting for writes.
            self.peer_lost = True
            logger.error("%s", lost)
            raise


def _gather(values: np.ndarray, step: int) -> np.ndarray:
    try:
        return np.asarray(multihost_utils.process_allgather(values))
    except Exception as error:  # a collective with a dead peer fails at once
        raise PeerError(
            f"Agreeing with the other JAX processes after step {step} failed: one of them stopped answering "
            f"(it probably died; its own log says why). This process stops too. ({type(error).__name__}: "
            f"{str(error)[:300]})") from error
