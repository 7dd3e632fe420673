"""Decisions that every JAX process takes at the same step.

With several processes, each step is one SPMD program: if one process stopped, saved
or wrote at a step where another did not, the collectives of the two would no longer
match and both would hang. So the processes exchange a few numbers (one all-gather of
a small vector) at agreement points and act on them together: a stop that one of them
requested, the end of its data, an error it raised, and the chief's clock, which every
seconds-based trigger then reads, so that "every 600 seconds" fires at one step on all.

An agreement waits for the device (the all-gather runs there, after the queued steps),
so the processes agree only where a host read happens anyway, or at a bounded cadence:
after the run that ends at

- a step where some hook of any process acts (its trigger fires), and the step before
  it (so that the clock a hook reads there is one step old, as with every run agreed);
- the run after an agreement that found a seconds-based trigger due on the chief's clock;
- every multiple of `agree_every_n_steps`;
- the last step for which some process still has a batch taken ahead.

Between two agreement points no process waits for another: each knows the next one,
and has its batches up to it taken ahead. With `steps_per_dispatch`, a run never
crosses the next agreement point; as no hook of any process acts before it (a hook's
exact trigger is an agreement point), every process cuts its runs at the same steps
(the largest powers of two that fit) and dispatches the same programs. A stop request
made between them (a chief-only one, say) takes effect at the next. A process that
dies between them makes the others raise `PeerError` when a step's collective fails
for it (at once on CPU, where gloo reports the closed connection), at the latest at
the next agreement; where a collective hangs instead, JAX's coordination service ends
the survivors after its heartbeat timeout (see `jaxmon.distributed`). A process that
lost a peer leaves without JAX's shutdown barrier, which would wait for the dead one:
at exit it ends with `PEER_LOST_EXIT_CODE`, whatever it was about to exit with.
"""

from __future__ import annotations

import atexit
import itertools
import json
import logging
import math
import os
import re
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple, Protocol

import jax
import numpy as np
from jax.experimental import multihost_utils

from jaxmon._base import signals as _signals
from jaxmon._base.errors import RollbackError
from jaxmon._processes.stragglers import Stragglers

logger = logging.getLogger("jaxmon")

_MESSAGE_BYTES = 512
#: The time categories of the hooks' events (`TimeSpent`): not host time a straggler is slow by.
_HOOK_CATEGORIES = ("hooks", "evaluation", "checkpoint")
#: The exit code of a process that stops because another process of its run died or
#: stopped answering (sysexits' EX_TEMPFAIL: the same command, started again on every
#: process, resumes from the last complete checkpoint).
PEER_LOST_EXIT_CODE = 75
# How a step's collective fails when a peer died (CPU: gloo; GPU: NCCL; or JAX's heartbeat).
_PEER_LOST = re.compile(r"Gloo .*failed|NCCL|Connection (?:closed|reset) by peer|heartbeat", re.IGNORECASE)


class PeerError(RuntimeError):
    """Another JAX process of this run failed, or stopped answering; every process
    raises it (the failing one raises its own error) at the same step.

    Attributes:
      step: the step the failure belongs to: the failing error's own `.step` where it
        has one (a `NanLossDuringTrainingError`'s first non-finite step), else the step
        the processes stopped at; None when a peer stopped answering.
      lost: True when a peer stopped answering (it died), False when it reported its
        own error.
      exit_code: what `jaxmon train` exits with: `PEER_LOST_EXIT_CODE` (75) for a lost
        peer, 1 for a peer's error (its own log says which).
    """

    def __init__(self, message: str, step: int | None = None, *, lost: bool = False):
        super().__init__(message)
        self.step, self.lost = step, lost

    @property
    def exit_code(self) -> int:
        return PEER_LOST_EXIT_CODE if self.lost else 1


def peer_lost() -> bool:
    """Whether this process has lost a peer (raised a `PeerError` for a process that
    stopped answering)."""
    return _lost[0]


_lost = [False]
#: How the one line starts that ends a process whose coordination service failed (see
#: `jaxmon.distributed`): the command's own prefix, and where the process is in the run.
failure_line = {"prefix": "jaxmon: ", "where": ""}
#: Seconds the one that did not claim the end of a process that lost a peer waits for the
#: one that did to end it (see `claim_end`).
END_GRACE_SECS = 10.0
_ender: list[str] = []
_ender_lock = threading.Lock()


def claim_end(who: str) -> bool:
    """Whether `who` ends this process after a lost peer, with its one last line: the
    first to ask, of "session" (a `PeerError` raised to the command) and "client" (JAX's
    coordination client, on its own thread). Two that both wrote a last line at once
    would each point stderr at the null device before writing: the second would write
    there, and if it ended the process first, no line would be left."""
    with _ender_lock:
        if not _ender:
            _ender.append(who)
        return _ender[0] == who


def _peer_lost(message: str) -> PeerError:
    """A `PeerError(lost=True)`, this process marked as one that lost a peer: at exit it
    leaves without JAX's shutdown barrier (see `_leave`). Where JAX's client is ending the
    process already, it is given `END_GRACE_SECS` to finish first."""
    if not claim_end("session"):
        time.sleep(END_GRACE_SECS)
    if not _lost[0]:
        _lost[0] = True
        atexit.register(_leave)  # registered last, so run first: before JAX's own shutdown
    return PeerError(message, lost=True)


def _leave() -> None:
    """At exit after a lost peer: ends the process with `PEER_LOST_EXIT_CODE` before
    JAX's atexit shutdown, whose barrier would wait for the dead process until the
    heartbeat timeout and then abort with a native stack dump."""
    from jax._src import distributed

    if distributed.global_state.client is None:  # shut down already, or never connected
        return
    _signals.flush_std_streams()
    logging.shutdown()
    os._exit(PEER_LOST_EXIT_CODE)


class Decision(NamedTuple):
    stop: bool  # a process asked to stop (or its data ended): every process stops now
    stopped_by: tuple[int, ...]
    failure: tuple[int, str, int] | None  # (process, error, its step) of the first process that failed
    next: int  # the step after whose run the processes agree next
    rollback: int | None = None  # every failure is a NanHook's roll-back: the latest bad step of them
    hosts: tuple[float, ...] = ()  # every process's host seconds per step since the last agreement


class Plan(NamedTuple):
    """What one process needs of the steps until the next agreement."""

    event: float  # the step of its next run that calls a hook (<= the current step: the next run)
    deadline: float  # the time, on the agreed clock, at which a sleeping hook of it wakes (inf: none)
    batches: float  # how many batches it has taken ahead (inf: it is given its batches)


class Agreement:
    """One all-gather of `[stop, failed, chief's clock, error step, plan]` across processes."""

    def __init__(self, clock: Any = time.monotonic):
        self.process_index, self.process_count = jax.process_index(), jax.process_count()
        self._clock = clock
        self.time = clock()  # the chief's clock at the last agreement
        self.rounds = 0

    def clock(self) -> float:
        """The agreed time: the chief's clock at the last agreement (the same number on
        every process until the next one)."""
        return self.time

    def __call__(self, step: int, *, stop: bool, error: BaseException | None, plan: Plan, every: int,
                 host: float = math.nan) -> Decision:
        chief_time = self._clock() if self.process_index == 0 else 0.0
        error_step = getattr(error, "step", None)
        error_step = error_step if isinstance(error_step, int) and not isinstance(error_step, bool) else step
        flags = np.array([float(stop), float(error is not None), chief_time, error_step, *plan,
                          float(isinstance(error, RollbackError)), host], np.float64)
        everyone = _gather(flags, step)
        self.rounds += 1
        self.time = float(everyone[0, 2])
        failed = [int(i) for i in np.flatnonzero(everyone[:, 1])]
        failure = None
        if failed:
            text = "" if error is None else f"{type(error).__name__}: {error}"
            data = np.frombuffer(text.encode()[:_MESSAGE_BYTES].ljust(_MESSAGE_BYTES, b"\0"), np.uint8)
            messages = _gather(data, step)
            message = bytes(messages[failed[0]]).rstrip(b"\0").decode(errors="replace")
            failure = (failed[0], message, int(everyone[failed[0], 3]))
        batches = everyone[:, 6]
        stopped_by = tuple(int(i) for i in np.flatnonzero((everyone[:, 0] > 0) | (batches <= 0)))
        event = float(everyone[:, 4].min())
        if (everyone[:, 5] <= self.time).any():  # a seconds-based trigger is due: its hook acts next run
            event = step + 1
        next_step = min(event - 1 if event - 1 > step else event,  # the step before a trigger too
                        (step // every + 1) * every, step + float(batches.min()))
        rollback = int(everyone[failed, 3].max()) if failed and everyone[failed, 7].all() else None
        return Decision(bool(stopped_by) or bool(failed), stopped_by, failure, int(max(step + 1, next_step)),
                        rollback, tuple(float(host) for host in everyone[:, 8]))

    def all(self, flag: bool, step: int) -> bool:
        """Whether `flag` is True on every process."""
        return bool(_gather(np.array([float(flag)]), step).all())

    def gather(self, value: Any, step: int) -> list[Any]:
        """Every process's `value` (JSON-serialisable): two all-gathers, its length, then its text."""
        text = json.dumps(value).encode()
        longest = int(_gather(np.array([len(text)], np.int64), step).max())
        padded = np.frombuffer(text.ljust(longest, b" "), np.uint8)
        return [json.loads(bytes(row)) for row in _gather(padded, step)]


class Batches(Protocol):
    """What the agreement takes of a session's batches (`_run.batches.BatchSource`)."""

    has_data: bool

    def next(self, step: int, limit: int | None = None) -> Any: ...

    def fill(self, count: int, timed: bool = False) -> int: ...


class Runner(Protocol):
    """What the agreement takes of a session's hook runner (`_run.hook_runner.HookRunner`)."""

    def deliver_late(self) -> None: ...

    def next_event(self) -> tuple[float, float]: ...


class Stops(Protocol):
    """What the agreement reads and records of a session's stops (`_run.stopping.Stopping`)."""

    requested: bool
    decided: bool

    def agree(self) -> None: ...

    def rolled_back(self) -> None: ...


class Steps(Protocol):
    """The session as the agreement sees it: its step number now (and, where it has one,
    its `summary_dir`, for the straggler summaries)."""

    @property
    def step(self) -> int: ...


class AgreedRuns:
    """A session's runs when several JAX processes share the step: at each agreement
    point (see the module's docstring), every process learns whether any of them asked
    to stop, ran out of data or failed, and all act on it at this same step; between
    agreement points, runs dispatch without any host sync.

    Args:
      batches: the session's `BatchSource`: at each agreement, every process takes
        ahead the batches of the steps up to the next one at most, so that the end of
        one process's data is known to all before any of them runs dry.
      runner: the session's `HookRunner`: when its hooks act next (`next_event`), and their
        late results, delivered before agreeing. Their seconds-based timers read the agreed
        `clock` (the session sets them).
      stopping: the session's `Stopping`: whether this process asked to stop, and where
        the agreed stop is recorded.
      session: the session, whose `step` is the step number now.
      every_n_steps: agree at least at every multiple of this many steps.
      recreate: `recreate(error)` restores the newest checkpoint after the roll-back `error`.
      spent: the session's seconds by category (`TimeSpent.secs`): its hooks' events are not
        host time a straggler is slow by.
    """

    def __init__(self, batches: Batches, runner: Runner, stopping: Stops, session: Steps, *, every_n_steps: int,
                 recreate: Callable[[BaseException], None] | None = None, spent: Mapping[str, float] | None = None):
        self._agreement = Agreement()
        self._recreate, self._spent = recreate, {} if spent is None else spent
        #: Every process's host time per step, and the reports of a straggler.
        self.stragglers = Stragglers()
        self._batches, self._runner, self._stopping, self._session = batches, runner, stopping, session
        self.every_n_steps = every_n_steps
        #: The step after whose run the processes agree next (None: before the first run).
        self.next: int | None = None
        #: True once another process stopped answering.
        self.peer_lost = False
        self._held: BaseException | None = None  # an error raised between agreement points
        self._agreed_at: int | None = None  # the step of the last agreement

    def clock(self) -> float:
        """The agreed time (the chief's clock at the last agreement), the same on every
        process: what seconds-based triggers read with several processes."""
        return self._agreement.clock()

    @property
    def rounds(self) -> int:
        """How many agreements this process took part in."""
        return self._agreement.rounds

    def run(self, run_once: Callable[[Any], Any], batch: Any) -> Any:
        """`run_once(batch)` (None: the next batch of data), then the agreement if its
        step is an agreement point (before the first run, one more). A roll-back agreed
        there (`RollbackError`) re-creates the state on every process (`recreate`), which
        then agree again and run."""
        while True:
            try:
                return self._run(run_once, batch)
            except RollbackError as error:
                if self._recreate is None or not getattr(error, "agreed", False):
                    raise  # not agreed by every process: raised as the NaN it is
                self._stopping.rolled_back()
                self._recreate(error)
                self.next = None
                batch = None if self._batches.has_data else batch

    def _run(self, run_once: Callable[[Any], Any], batch: Any) -> Any:
        if self.next is None:
            self._agree(None)
            if self._stopping.decided:
                raise StopIteration("Every JAX process stops before its first run: one of them asked to stop "
                                    "or has no data.")
        if batch is None and self._batches.has_data:  # a run of several steps never crosses an agreement point
            batch = self._batches.next(self._session.step, self.next - self._session.step)
        before, error, result = self._session.step, None, None
        try:
            result = run_once(batch)
        except Exception as raised:
            if self._session.step == before:  # the step never ran here: the others wait in it for this process
                if isinstance(raised, PeerError):  # its first program's barrier (`every_process_at`)
                    self.peer_lost = self.peer_lost or raised.lost
                    logger.error("%s", raised)
                    raise
                if _PEER_LOST.search(str(raised)):  # its collective failed: a peer died between agreements
                    self.peer_lost = True
                    lost = _peer_lost(f"A collective of step {before + 1} failed: another JAX process stopped "
                                      f"answering (it probably died; its own log says why). This process stops "
                                      f"too. ({type(raised).__name__}: {str(raised)[:300]})")
                    logger.error("%s", lost)
                    raise lost from raised
                raise
            error = raised  # after the step (a hook's after_run, e.g. a NaN): raised once all agree
        if self._session.step < self.next:  # between agreement points: an error waits for the next one
            self._held = self._held or error
            return result
        self._agree(error)
        return result

    def close(self) -> None:
        """At a clean close, one more agreement unless the last run was an agreement point,
        so that an error held since then is raised (and a `PeerError` on the others)."""
        if self.next is not None and self._session.step != self._agreed_at:
            self._agree(None, closing=True)

    def _agree(self, error: BaseException | None, closing: bool = False) -> None:
        step = self._agreed_at = self._session.step
        error, self._held = self._held or error, None
        try:
            self._runner.deliver_late()  # late results (a NaN, a stop) count at this agreement
        except Exception as raised:
            error = error or raised
        stop = isinstance(error, StopIteration)  # a hook's StopIteration: the end of data, a clean stop
        error = None if stop else error
        batches = math.inf
        if self._batches.has_data and not closing:
            try:
                batches = self._batches.fill(self.every_n_steps, timed=True)
            except Exception as raised:  # the loader failed: every process stops, this one raises it
                error = error or raised
        event, deadline = self._runner.next_event()
        hook_secs = sum(self._spent.get(category, 0.0) for category in _HOOK_CATEGORIES)
        decision = self._agreed(self._agreement, step, stop=stop or self._stopping.requested, error=error,
                                plan=Plan(event, deadline, batches), every=self.every_n_steps,
                                host=self.stragglers.measure(step, hook_secs))
        self.stragglers.agreed(step, decision.hosts, getattr(self._session, "summary_dir", None), hook_secs)
        self.next = decision.next
        if decision.rollback is not None:  # every process rolls back together, past the latest bad step of any
            if not isinstance(error, RollbackError):
                error = RollbackError(f"JAX process {decision.failure[0]} rolls back after step {step}: "
                                      f"{decision.failure[1]}. Every process rolls back with it.")
            error.step, error.agreed = decision.rollback, True
            raise error
        if decision.failure is not None:
            self._stopping.agree()
            if error is not None:
                raise error
            process, message, failed_step = decision.failure
            raise PeerError(f"JAX process {process} failed after step {step}: {message}. "
                            f"Every process of the run stops at this step.", step=failed_step)
        if decision.stop and not self._stopping.decided:
            self._stopping.agree()
            if len(decision.stopped_by) < self._agreement.process_count:  # not a stop all of them took
                logger.info("Process(es) %s asked to stop (or ran out of data) by step %d: every process "
                            "stops there.", list(decision.stopped_by), step)

    def all(self, flag: bool) -> bool:
        """Whether `flag` holds on every process (every process calls it at one point)."""
        return self._agreed(self._agreement.all, bool(flag), self._session.step)

    def gather(self, value: Any) -> list[Any]:
        """Every process's `value` (JSON), in process order (every process calls it at one point)."""
        return self._agreed(self._agreement.gather, value, self._session.step)

    def _agreed(self, agree: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        try:
            return agree(*args, **kwargs)
        except PeerError as lost:
            # Say so now, in case the process ends before a traceback is printed (JAX's
            # coordination client may end it: see jaxmon.distributed). Checkpoint savers
            # stop waiting for writes.
            self.peer_lost = True
            logger.error("%s", lost)
            raise


_barriers = itertools.count()  # every process passes the same barriers in the same order
#: JAX's barriers need a bound: a day. What ends a wait for a process that never comes is
#: the coordination service's report of a dead or hung peer (`jaxmon.distributed`'s
#: heartbeat timeout) or the waiting process's watchdog (`watchdog_startup_secs`).
_BARRIER_SECS = 24 * 3600


def every_process_at(what: str) -> float:
    """Waits until every JAX process of the run has come to this point, where each has
    done `what` (say "compiled the step"); returns the seconds waited. A barrier of JAX's
    coordination service, no collective: a collective whose communicator is new (on
    CPU, gloo's, for a group of devices it has not joined yet) gives a late peer 30 s,
    where a process that compiles from scratch may come minutes after one that found its
    programs in the cache."""
    from jax._src import distributed

    client = distributed.global_state.client
    if client is None or jax.process_count() == 1:
        return 0.0
    started = time.perf_counter()
    try:
        client.wait_at_barrier(f"jaxmon/{next(_barriers)}", _BARRIER_SECS * 1000)
    except Exception as error:  # the coordination service's report of a dead or hung peer
        raise _peer_lost(
            f"While this process waited for the others to have {what}, one of them stopped answering (it "
            f"probably died; its own log says why). This process stops too. ({type(error).__name__}: "
            f"{str(error)[:300]})") from error
    return time.perf_counter() - started


def _gather(values: np.ndarray, step: int) -> np.ndarray:
    try:
        return np.asarray(multihost_utils.process_allgather(values))
    except Exception as error:  # a collective with a dead peer fails at once
        raise _peer_lost(
            f"Agreeing with the other JAX processes after step {step} failed: one of them stopped answering "
            f"(it probably died; its own log says why). This process stops too. ({type(error).__name__}: "
            f"{str(error)[:300]})") from error
