"""Where a session's batches come from: its data, taken ahead and sent to the device
ahead of their run (stacked for a run of several steps), with the data position a
checkpoint keeps."""

from __future__ import annotations

import collections
import contextlib
import itertools
import logging
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import jax
import numpy as np

from jaxmon._data import loaders as _loaders
from jaxmon._ops.host_syncs import HOST_VALUES, HostSyncs
from jaxmon._ops.time_spent import TimeSpent

logger = logging.getLogger("jaxmon")
_UNTIMED = contextlib.nullcontext()


class Placed(NamedTuple):
    """One run's batch on the device, as its compiled program takes it.

    Attributes:
      batch: what the program takes: one step's batch, or a run's batches stacked on a
        leading axis (padded to `program_steps`), placed on the device (on a mesh, with
        the batch sharding).
      given: the run's batch as hooks see it (`RunContext.original_args.feeds`): the
        batch, or the list of a run's batches.
      steps: the steps of the run.
      program_steps: the leading axis of `batch` for a run of several steps (see
        `CompiledStep.program_steps`), 1 for one step's batch.
      length: `steps` on the device, for a program that takes every run length (else None).
    """

    batch: Any
    given: Any
    steps: int
    program_steps: int = 1
    length: Any = None


class _Taken(NamedTuple):
    """A batch taken ahead from the data, and the data position before it."""

    batch: Any
    position: Any


class _Ahead(NamedTuple):
    """A run placed on the device ahead of it: the step it starts after, and its batch."""

    step: int
    run: Placed


class BatchSource:
    """The session's `data`: the batches of each run, and the position before them.

    Batches taken ahead (for the runs placed ahead, for a multi-step run cut short, to
    learn early that the data ended, or up to the next agreement of several processes)
    wait in a buffer with the data position before each, so that a checkpoint records
    the position of the first batch not yet run.

    The next `prefetch` runs' batches go to the device ahead of their run (`place`; a
    run of several steps stacked on the host first, one copy a run): `jax.device_put`
    returns at once, as flax's `prefetch_to_device`, so the copy overlaps the steps
    before, and no dispatch copies a batch. A run's length is the one the hooks'
    schedules give when it is placed (`run_limit`); a run the hooks end elsewhere is
    placed again when it is due.

    Args:
      data: an iterable of batches, or None (every run is given its batch); its
        iterator may have `get_state()` and `set_state(state)` (an exact resume
        needs both).
      steps_per_dispatch: the most steps one run takes.
      run_limit: `run_limit(step, limit)`: `limit` cut to the next step a hook needs
        a run to end on.
      prefetch: how many runs are placed on the device ahead; 0, or data whose
        batches are already on the device, gives each run its batches as they are.
      place: `place(batches) -> Placed | None`: one run's batches (a list) on the
        device as its program takes them (a session's `Dispatch.place_run`), None
        where it cannot say yet; None: `place_on_device`.
      host_syncs: with `debug_host_syncs`, the guard each batch is taken under.
      spent: the session's clocks (`TimeSpent`); taking and placing batches adds to "data".

    An iterator the session made (`data` was an iterable, such as a grain dataset or
    DataLoader) is closed with the session, which stops its worker processes; one given
    as an iterator is the caller's, set back to its first batch not run.
    """

    def __init__(self, data: Iterable[Any] | None, steps_per_dispatch: int, run_limit: Callable[[int, int], int],
                 prefetch: int = 0, place: Callable[[list[Any]], Placed | None] | None = None,
                 host_syncs: HostSyncs | None = None, spent: TimeSpent | None = None):
        if data is not None and _loaders.is_grain(data):
            _loaders.prepare_grain()
        self._data = None if data is None else iter(data)
        owned = data is not None and self._data is not data
        self._spent = TimeSpent() if spent is None else spent
        if host_syncs is not None:  # debug_host_syncs: a batch taken reads no device value
            self._data = host_syncs.iterator(self._data)
        self.kind = type(data).__name__  # what a resume's warnings name
        self._told_no_position = False
        #: Whether runs take their batches from `data` (else each run is given one).
        self.has_data = self._data is not None
        self._owned = owned
        self._place = place_on_device if place is None else place
        self._steps_per_dispatch = steps_per_dispatch
        self._prefetch = prefetch  # 0 once the data turns out to be on the device already
        self._run_limit = run_limit
        positions = getattr(self._data, "get_state", None)
        self._positions: Callable[[], Any] | None = positions if callable(positions) else None
        self._buffer: collections.deque[_Taken] = collections.deque()
        self._placed: collections.deque[_Ahead] = collections.deque()  # the first runs of the buffer, on the device
        self._deferred: BaseException | None = None  # what taking a batch ahead raised

    def next(self, step: int, limit: int | None = None) -> Any:
        """The batch of the run after `step`: one batch, or with `steps_per_dispatch` as
        many as the next trigger after `step` and `limit` (the most steps the run may
        take: with several processes, those to their next agreement) allow, a power of
        two (a `Steps`); a `Placed` run where it went to the device. Its time goes to the
        session's `data` clock."""
        with self._spent.timing("data"):
            if not self._prefetch and not self._buffer and self._deferred is None and self._steps_per_dispatch == 1:
                return next(self._data)
            length = self._length(step, limit)
            ahead = self._placed.popleft() if self._placed else None
            if ahead is not None and (ahead.step, ahead.run.steps) != (step, length):  # the hooks end it elsewhere
                self._placed.clear()
                ahead = None
            self._fill(length)
            if len(self._buffer) < length:  # the data ended: what is left, in powers of two
                if not self._buffer:
                    error, self._deferred = self._deferred, None
                    raise error
                length = run_length(len(self._buffer))
            batches = [self._buffer.popleft().batch for _ in range(length)]
            run = ahead.run if ahead is not None else self._placed_run(batches)
            self._place_ahead(step + length, None if limit is None else step + limit)
            if run is not None:
                return run
            return batches[0] if length == 1 else Steps(batches)

    def _length(self, step: int, limit: int | None) -> int:
        """How many steps the run after `step` takes, as the hooks' schedules say now."""
        if self._steps_per_dispatch == 1:
            return 1
        most = self._steps_per_dispatch if limit is None else min(limit, self._steps_per_dispatch)
        return run_length(self._run_limit(step, most))

    def _place_ahead(self, step: int, end: int | None) -> None:
        """Places the runs after `step` on the device, until `prefetch` of them wait (`end`:
        the step no run crosses, several processes' next agreement; past it, unknown)."""
        queued = sum(ahead.run.steps for ahead in self._placed)
        while len(self._placed) < self._prefetch:
            start = step + queued
            length = self._length(start, None if end is None or end <= start else end - start)
            self._fill(queued + length)
            if len(self._buffer) < queued + length:  # the data ends first: that run is cut when it is due
                return
            run = self._placed_run([taken.batch for taken in itertools.islice(self._buffer, queued, queued + length)])
            if run is None:
                return
            self._placed.append(_Ahead(start, run))
            queued += length

    def _placed_run(self, batches: list[Any]) -> Placed | None:
        """`batches`, one run's, on the device; None without prefetch, for data already
        on the device, or where the session cannot place them yet."""
        if not self._prefetch:
            return None
        if not on_host(batches[0]):
            self._prefetch = 0  # data already on the device: nothing to gain from placing it ahead
            return None
        return self._place(batches)

    def unplace(self) -> None:
        """Drops the runs placed ahead (the state was made again: a recovery may have
        lost the device's buffers); their batches are placed again when due."""
        self._placed.clear()

    def skip(self, count: int) -> list[Any]:
        """Takes the next `count` batches and drops them (a roll-back past bad data);
        returns the data position before each."""
        self._placed.clear()
        positions = []
        for _ in range(count):
            positions.append(self.position())
            if self._buffer:
                self._buffer.popleft()
            else:
                next(self._data)
        return positions

    def fill(self, count: int, timed: bool = False) -> int:
        """Takes batches ahead until `count` wait, or the data ends; returns how many
        wait. An error of the data other than its end is raised now. `timed`: its time
        goes to the session's `data` clock (`next` times its own)."""
        with self._spent.timing("data") if timed else _UNTIMED:
            self._fill(count)
            if self._deferred is not None and not isinstance(self._deferred, StopIteration):
                error, self._deferred = self._deferred, None
                raise error
            return len(self._buffer)

    def _fill(self, count: int) -> None:
        """Takes batches ahead until `count` wait; the data's end, or its error, is kept
        for the run whose batch it would have been."""
        while len(self._buffer) < count and self._deferred is None:
            position = self._get_state()
            try:
                batch = next(self._data)
            except Exception as error:  # raised when that batch is due, not now (as the data's end)
                self._deferred = error
                return
            self._buffer.append(_Taken(batch, position))

    def _get_state(self) -> Any:
        return None if self._positions is None else self._positions()

    def give_back(self) -> None:
        """At the session's end: closes an iterator the session made; sets one it was given
        back to the first batch taken ahead but not run (when it has `set_state`), so that
        it carries on from there after the session (one without has lost those batches)."""
        self._placed.clear()
        if self._owned:
            self._buffer.clear()
            _loaders.close_iterator(self._data)
        elif self._buffer and hasattr(self._data, "set_state"):
            self._data.set_state(self._buffer[0].position)
            self._buffer.clear()
            self._deferred = None

    def position(self) -> Any:
        """The data position before the next batch to run, as JSON (None when the
        iterator has no `get_state()`)."""
        return _loaders.to_json(self._buffer[0].position if self._buffer else self._get_state())

    def restore(self, position: Any, step: int, recovering: bool) -> bool:
        """Sets the data back to a checkpoint's `position` (of `step`), or says why not;
        returns whether it did (a batch in hand is then past that position)."""
        if position is not None:
            if hasattr(self._data, "set_state"):
                self._data.set_state(_loaders.from_json(position))
                self._buffer.clear()
                self._placed.clear()
                self._deferred = None
                return True
            else:
                logger.warning("Checkpoint %d holds a data position, but this session's data has no set_state(); "
                               "the data restarts from where it is.", step)
        elif not recovering and hasattr(self._data, "get_state"):
            logger.warning("Checkpoint %d holds no data position; the data restarts from its beginning.", step)
        elif not recovering and self._data is not None and not self._told_no_position:
            self._told_no_position = True
            logger.warning("Resumed from checkpoint %d, but this session's data (a %s) has no get_state(), so no "
                           "checkpoint holds its position: the run takes batches from where the data is now (its "
                           "first batch, for data made afresh), not from where the checkpoint's run left it. Give "
                           "data with get_state()/set_state(): jm.ArrayDataSource, a grain dataset, or "
                           "jm.ResumableIterator(...) around a list, a loader or a function that returns a fresh "
                           "iterator.", step, self.kind)
        return False


def place_on_device(batches: list[Any]) -> Placed:
    """One run's host `batches` on the default device, with `jax.device_put`: one batch,
    or several stacked on the host (a program of the run's own length)."""
    steps = len(batches)
    if steps == 1:
        return Placed(jax.device_put(batches[0]), batches[0], 1)
    return Placed(jax.device_put(Steps(batches).stacked()), batches, steps, steps)


def as_run(batch: Any, steps_per_dispatch: int) -> tuple[int, Any, Any]:
    """`(steps, batch, given)` of one run: `given` is the run's batch as hooks see it;
    `batch` what the step gets. A `Placed` run is as it was placed. Otherwise, for a run
    of several steps (a list of batches given to `run()` with `steps_per_dispatch`, or
    taken from data), host arrays stacked on a new leading axis here, batches already on
    the device as a list, which the compiled step stacks inside its own program (no
    dispatch of its own); a run of one step gets its batch twice."""
    if isinstance(batch, Placed):
        return batch.steps, batch, batch.given
    if isinstance(batch, list) and steps_per_dispatch > 1:
        batch = Steps(batch)
    if isinstance(batch, Steps):
        return len(batch.items), batch.stacked(), batch.items
    return 1, batch, batch


def pad_run(batch: Any, steps: int, size: int) -> Any:
    """A run of `steps` steps (`batch` as `as_run` gives it) as a batch of `size` steps
    for a program that takes only the first `steps` (see `CompiledStep.program_steps`): the
    last step's batch repeated, as a list on the device, stacked on the host."""
    if isinstance(batch, list) and steps > 1:
        return batch + [batch[-1]] * (size - steps)
    if steps == 1:
        if on_device(batch):
            return [batch] * size
        return jax.tree.map(lambda x: np.broadcast_to(np.asarray(x), (size, *np.shape(x))), batch)
    return jax.tree.map(lambda x: np.concatenate([np.asarray(x), np.repeat(np.asarray(x)[-1:], size - steps, 0)]),
                        batch)


def run_lengths(steps_per_dispatch: int) -> list[int]:
    """Every length a run may take, longest first: the powers of two up to
    `steps_per_dispatch` (8, 4, 2, 1)."""
    return [1 << n for n in reversed(range(steps_per_dispatch.bit_length()))]


def run_length(limit: int) -> int:
    """The longest run length (a power of two, see `run_lengths`) of at most `limit` steps; 1 at least."""
    return 1 << (max(1, limit).bit_length() - 1)


class Steps:
    """The batches of one multi-step run, stacked on a new leading axis when used."""

    def __init__(self, items: list[Any]):
        if not items:
            raise ValueError("run() was given an empty list of batches; give at least one.")
        self.items = items

    def stacked(self) -> Any:
        """Host batches stacked on a new leading axis; batches on the device as they are,
        a list (see `as_run`: the step stacks them, and checks their shapes then)."""
        if on_device(self.items[0]):
            return self.items
        try:
            return jax.tree.map(_stack, *self.items)
        except ValueError as error:
            raise unstackable(len(self.items), error) from None


def unstackable(count: int, error: Exception) -> ValueError:
    return ValueError(f"The {count} batches of one run must have the same structure and shapes to be stacked "
                      f"for steps_per_dispatch: {error}")


def _stack(*leaves: Any) -> Any:
    return np.stack([np.asarray(leaf) for leaf in leaves])


def stack_leaves(items: list[Any]) -> Any:
    """The batches `items` stacked leaf by leaf on a new leading axis (traced)."""
    try:
        return jax.tree.map(lambda *leaves: jax.numpy.stack(leaves), *items)
    except (ValueError, TypeError) as error:
        raise unstackable(len(items), error) from None


def on_host(batch: Any) -> bool:
    """Whether `batch` holds a host value (a NumPy array or a Python number), which goes
    to the device before its step."""
    return any(isinstance(leaf, HOST_VALUES) for leaf in jax.tree.leaves(batch))


def on_device(batch: Any) -> bool:
    """Whether every array of `batch` is on the device (a run of several takes such
    batches as a list, see `as_run`)."""
    return all(isinstance(leaf, jax.Array) for leaf in jax.tree.leaves(batch))
