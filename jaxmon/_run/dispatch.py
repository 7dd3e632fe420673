"""One run's dispatch: a `RunPlan` in, a `RunResult` out: the hooks' feeds merged, one
fetch plan for the caller and every hook, the compiled call, the bound on steps queued
ahead, and the last run kept for `fetch`."""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import jax
import numpy as np

from jaxmon._base import errors
from jaxmon._base import fetches as _fetches
from jaxmon._base.errors import with_article
from jaxmon._base.hook import Hook
from jaxmon._metrics.accumulators import Accumulators
from jaxmon._ops.host_syncs import HostSyncs
from jaxmon._ops.time_spent import TimeSpent
from jaxmon._run import sharding as _sharding
from jaxmon._run.batches import Placed, Steps, on_device, on_host, pad_run, run_lengths
from jaxmon._run.compiled_step import CompiledStep, check_batch
from jaxmon._run.plan import CALLER, RunPlan, RunResult

NOTHING_FETCHED = _fetches.FetchPlan([(CALLER, None)])
_AS_IS = contextlib.nullcontext()


class Dispatch:
    """Dispatches runs of one compiled step (see `CompiledStep`) and remembers the last.

    Args:
      step_fn: the user's step function.
      donate_state: donate the state's buffers to the step.
      placement: a sharded session's `sharding.Placement`, or None.
      max_dispatch_ahead: the most steps queued without waiting for one, None for no
        bound, or "auto" (see `sharding.dispatch_ahead_default`).
      accumulators: the hooks' accumulators, updated inside every step.
      steps_per_dispatch: the most steps of one run; every power of two up to it is a
        run length, compiled when a run first needs it (see `CompiledStep`).
      scan_unroll: how far the `lax.scan` of a run of several steps is unrolled (see
        `scan_unroll.resolve_scan_unroll`).
      host_syncs: with `debug_host_syncs`, an implicit host-to-device copy in a dispatch
        raises (every value jaxmon sends, it sends explicitly, ahead where it can).
    """

    def __init__(self, step_fn: Callable[..., Any], *, donate_state: bool, placement: _sharding.Placement | None,
                 max_dispatch_ahead: int | None | str, accumulators: Accumulators | None = None,
                 steps_per_dispatch: int = 1, scan_unroll: int | bool | str = "auto",
                 spent: TimeSpent | None = None, host_syncs: HostSyncs | None = None):
        if max_dispatch_ahead == "auto":
            max_dispatch_ahead = _sharding.dispatch_ahead_default(placement)
        if max_dispatch_ahead is not None:
            errors.check_int("max_dispatch_ahead", max_dispatch_ahead, minimum=1)
        self._accumulators = accumulators if accumulators is not None and accumulators.active else None
        self._spent = TimeSpent() if spent is None else spent
        self._compiled = CompiledStep(step_fn, donate_state=donate_state, lengths=run_lengths(steps_per_dispatch),
                                      accumulate=self._accumulators and self._accumulators.update,
                                      unroll=scan_unroll, spent=self._spent)
        self._syncs = host_syncs if host_syncs is not None and host_syncs.enabled else None
        self._placement = placement
        self._single = steps_per_dispatch == 1  # every run is one step, padded to no other length
        self.max_dispatch_ahead = max_dispatch_ahead
        self._in_flight: collections.deque = collections.deque()
        self._lengths: dict[int, Any] = {}  # run lengths on the device (`_length`)
        self._last_batch, self._last_index = None, None
        #: The last run's outputs (device arrays); empty before the first run.
        self.last_outputs: Mapping[str, Any] = {}

    @property
    def compile_count(self) -> int:
        self._compiled.wait_ahead()
        return self._compiled.trace_count

    def close(self) -> None:
        self._compiled.close()

    def created(self, state: Any) -> None:
        """A state was built or restored: the programs are chosen for its devices (see
        `CompiledStep.choose`); with a mesh, every new state keeps the shardings it has."""
        self._compiled.choose(state)
        if self._placement is not None and not self._compiled.constrained:
            self._compiled.constrain_state(_sharding.constrain(self._placement.state_shardings(state)))

    def place_run(self, batches: list[Any]) -> Placed | None:
        """One run's host `batches` on the device, as its program takes them (stacked on
        the host, padded to its program's length, placed on the mesh), for `BatchSource`
        to place ahead of the run; None before the programs are chosen, or for batches
        the step cannot take (their run raises when it is due, naming its step)."""
        if not self._compiled.chosen:
            return None
        steps = len(batches)
        try:
            run = self._placed(batches[0] if steps == 1 else Steps(batches).stacked(), steps)
        except (TypeError, ValueError):
            return None
        return run._replace(given=batches[0] if steps == 1 else batches)

    def _placed(self, batch: Any, steps: int, step: int | None = None) -> Placed:
        """A run's `batch` (as `as_run` gives it) as its program takes it, on the device;
        a batch the step cannot take is refused naming the run's first step (`step`)."""
        program_steps = 1 if self._single else self._compiled.program_steps(steps)
        if program_steps != steps:  # one program takes every run length: the batch padded to its length
            batch = pad_run(batch, steps, program_steps)
        try:
            placed = self._put(batch, program_steps)
        except TypeError:  # a leaf that is no array: say which, and of which step
            if step is not None:
                check_batch(batch, step + 1)
            raise
        return Placed(placed, None, steps, program_steps, self._length(steps) if self._compiled.dynamic else None)

    def _length(self, steps: int) -> Any:
        """A run's length on the device, sent once per length (a `device_put` of a scalar
        costs the host ~0.1 ms)."""
        length = self._lengths.get(steps)
        if length is None:
            length = self._lengths[steps] = self._put(np.int32(steps), 1)
        return length

    def _put(self, batch: Any, steps: int) -> Any:
        """`batch` (of `steps` steps) on the device: with a mesh, on it (`place_batch`);
        else its host values copied with `jax.device_put`, never at the dispatch."""
        if self._placement is not None:
            return self._placement.place_batch(batch, steps)
        return jax.device_put(batch) if on_host(batch) else batch

    def __call__(self, state: Any, batch: Any, plan: RunPlan, *, wanted: _fetches.Wanted | None, steps: int,
                 step: int) -> RunResult:
        """Dispatches the run of `steps` steps after `step` (`batch` as `as_run` gives it:
        placed ahead, or placed here), with the hooks' feeds of `plan` merged into it
        and every fetch of `plan` and the caller's (`wanted`) computed in the same
        program; a quiet plan fetches nothing."""
        fetches = NOTHING_FETCHED
        if wanted is not None or plan.fetching:  # most runs fetch nothing
            fetches = plan.fetch_plan(wanted)
        self._compiled.choose(state)
        run, listed = batch, False  # listed: runs of several steps get their batches as a list (on the device)
        if not isinstance(run, Placed):  # given to run(), or data not placed ahead: placed now
            if self._syncs is not None:
                self._syncs.refuse_host_batch(batch, f"of step {step + 1}")
            listed = len(self._compiled.lengths) > 1 and (
                isinstance(batch, list) if steps > 1 else on_device(batch))
            run = self._placed(batch, steps, step)
        fed = run.batch
        if plan.feeds:
            fed = self._put(_with_feeds(fed, plan.feeds, run.program_steps), run.program_steps)
        accumulators, carry = self._accumulators, None
        if accumulators is not None:
            carry = accumulators.carry
            if carry is None:  # the first run since the state was created: traces the step for the shapes
                with self._spent.timing("compile"):
                    carry = accumulators.prepare(self._compiled.traced_step_fn, state, fed,
                                                 program_steps=run.program_steps, step=step,
                                                 sharding=_carry_sharding(state, self._placement))
        try:
            with self._copies(step):
                result = self._compiled(fetches.key, state, fed, owners=fetches.owners,
                                        program_steps=run.program_steps, length=run.length, carry=carry,
                                        unfed=run.batch, step=step, listed=listed)
        except Exception as error:  # on the trace of a new program only: raising costs nothing before
            if self._placement is not None:
                _sharding.note_explicit_axes(error, self._placement.mesh)
            raise
        if accumulators is None:
            new_state, outputs, fetched = result
        else:
            new_state, outputs, fetched, carry = result
            accumulators.advance(carry)
        if self.max_dispatch_ahead is not None:
            self._bound(new_state, outputs, step)
        self._last_batch, self.last_outputs = fed, outputs
        self._last_index = steps - 1 if run.program_steps > 1 else None
        if fetches is NOTHING_FETCHED:
            return RunResult(new_state, outputs)
        caller, *values = fetches.route(outputs, fetched)  # a name that is no output raises on this run
        return RunResult(new_state, outputs, caller, _by_call(values, plan) if plan.fetching else ())

    def _copies(self, step: int) -> contextlib.AbstractContextManager:
        """Where the compiled call runs: with `debug_host_syncs`, refusing implicit copies."""
        if self._syncs is None:
            return _AS_IS
        return self._syncs.copies(f"in the dispatch of step {step + 1}")

    def _bound(self, state: Any, outputs: Any, step: int) -> None:
        """Waits for the step `max_dispatch_ahead` runs back, so that no more than that
        many steps are ever queued on the device."""
        marker = next(iter(jax.tree.leaves(outputs)), None)
        if marker is None:  # nothing to wait on but the state, which the next run donates
            if (step + 1) % self.max_dispatch_ahead == 0:
                jax.block_until_ready(state)
            return
        self._in_flight.append(marker)
        if len(self._in_flight) > self.max_dispatch_ahead:
            self._in_flight.popleft().block_until_ready()

    def fetch(self, state: Any, fetches: Any) -> dict[str, Any]:
        """`fetches` on `state` and the last run's batch and outputs, without a step."""
        wanted = _fetches.normalize(fetches, "fetch(...)")
        if wanted is None:
            return {}
        batch, outputs = self._last_batch, self.last_outputs
        last = self._last_index
        if last is not None:  # the last step's batch of a multi-step run
            batch = batch[last] if isinstance(batch, list) else jax.tree.map(lambda x: x[last], batch)
        plan = _fetches.FetchPlan([("fetch(...)", wanted)])
        fetched = self._compiled.evaluate(plan.key, state, batch, outputs, plan.owners)
        [result] = plan.route(outputs, fetched)
        return jax.device_get(result)


def _carry_sharding(state: Any, placement: _sharding.Placement | None) -> Any:
    """Where the accumulators go: replicated on a mesh, else on the state's device,
    committed like the state (or the second run would compile again)."""
    if placement is not None:
        return placement.replicated
    leaf = next(iter(jax.tree.leaves(state)), None)
    return leaf.sharding if isinstance(leaf, jax.Array) and leaf.committed else None


def _by_call(values: list[Any], plan: RunPlan) -> tuple[Any, ...]:
    """The hooks' fetched `values` (those of the calls numbered `plan.fetching`), each at
    its call's place in `plan.calls`; None for the calls that fetch nothing."""
    placed = [None] * len(plan.calls)
    for at, value in zip(plan.fetching, values, strict=True):
        placed[at] = value
    return tuple(placed)


def _with_feeds(batch: Any, feeds: tuple[tuple[Hook, Mapping[str, Any]], ...], length: int) -> Any:
    """`batch` with the hooks' `feeds` merged in; in a run of several steps, each value
    for every step (batches on the device: merged into each)."""
    if length > 1 and isinstance(batch, list):
        return [merge_feeds(item, feeds) for item in batch]
    if length > 1:
        feeds = tuple((hook, {k: np.broadcast_to(np.asarray(v), (length, *np.shape(v))) for k, v in f.items()})
                      for hook, f in feeds)
    return merge_feeds(batch, feeds)


def merge_feeds(batch: Any, feeds: Iterable[tuple[Hook, Mapping[str, Any]]]) -> Any:
    """Merges the hooks' feeds into a new batch dict; a key fed twice is an error."""
    merged: dict[str, Any] = {}
    owners: dict[str, Hook] = {}
    for hook, hook_feeds in feeds:
        for key, value in hook_feeds.items():
            if key in merged:
                raise RuntimeError(
                    f"Same batch key is fed by two hooks: {key!r} by {owners[key]!r} and "
                    f"{hook!r}. Let one hook feed it."
                )
            merged[key], owners[key] = value, hook
    if not merged:
        return batch
    if batch is None:
        return merged
    if not isinstance(batch, Mapping):
        raise TypeError(
            f"Hooks feed {sorted(merged)}, but the batch is {with_article(type(batch).__name__)}, not a "
            "dict; feeds need dict batches."
        )
    clash = sorted(set(merged) & set(batch))
    if clash:
        raise RuntimeError(
            f"Same batch key is fed by a hook and the caller: {clash} is already in the batch "
            f"(given to run() or taken from data) and fed by {', '.join(repr(owners[k]) for k in clash)}. "
            "Drop it from the batch or from the hook's feeds."
        )
    return {**batch, **merged}
