"""Decisions that every JAX process takes at the same step.

With several processes, each step is one SPMD program: if one process stopped, saved
or wrote at a step where another did not, the collectives of the two would no longer
match and both would hang. So, after every run, the processes exchange a few numbers
(one all-gather of a small vector) and act on them together: a stop that one of them
requested, the end of its data, an error it raised, and the chief's clock, which every
seconds-based trigger then reads, so that "every 600 seconds" fires at one step on all.
"""

from __future__ import annotations

import logging
import time
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


def _gather(values: np.ndarray, step: int) -> np.ndarray:
    try:
        return np.asarray(multihost_utils.process_allgather(values))
    except Exception as error:  # a collective with a dead peer fails at once
        raise PeerError(
            f"Agreeing with the other JAX processes after step {step} failed: one of them stopped answering "
            f"(it probably died; its own log says why). This process stops too. ({type(error).__name__}: "
            f"{str(error)[:300]})") from error
