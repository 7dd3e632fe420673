"""One run's dispatch: feeds merged, the fetch plan, the compiled call, the bound on
steps queued ahead, and the last run kept for `fetch`."""

from __future__ import annotations

import collections
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np

from jaxmon import _errors, _fetches, _sharding
from jaxmon._hook import Hook
from jaxmon._hook_runner import Requests
from jaxmon._metrics import Monitors
from jaxmon._step import CompiledStep

NOTHING_FETCHED = _fetches.FetchPlan([("run(fetches=...)", None)])


class Dispatch:
    """Dispatches runs of one compiled step (see `CompiledStep`) and remembers the last.

    Args:
      step_fn: the user's step function.
      donate_state: donate the state's buffers to the step.
      placement: a sharded session's `_sharding.Placement`, or None.
      max_dispatch_ahead: the most steps queued without waiting for one, None for no
        bound, or "auto" (see `_sharding.dispatch_ahead_default`).
      monitors: the hooks' accumulators, updated inside every step (see `Monitors`).
      steps_per_dispatch: the most steps of one run; every power of two up to it is a
        run length that the step is compiled for ahead (see `CompiledStep`).
    """

    def __init__(self, step_fn: Callable[..., Any], *, donate_state: bool, placement: _sharding.Placement | None,
                 max_dispatch_ahead: int | None | str, monitors: Monitors | None = None, steps_per_dispatch: int = 1):
        if max_dispatch_ahead == "auto":
            max_dispatch_ahead = _sharding.dispatch_ahead_default(placement)
        if max_dispatch_ahead is not None:
            _errors.check_int("max_dispatch_ahead", max_dispatch_ahead, minimum=1)
        lengths = [1 << n for n in reversed(range(steps_per_dispatch.bit_length()))]  # 8, 4, 2, 1
        self._compiled = CompiledStep(step_fn, donate_state=donate_state, lengths=lengths)
        self._monitors = self._compiled.monitors = monitors if monitors is not None and monitors.active else None
        self._placement = placement
        self.max_dispatch_ahead = max_dispatch_ahead
        self._in_flight: collections.deque = collections.deque()
        self.last_run: tuple[Any, Any] = (None, {})  # (batch, outputs)
        self._last_length = 1

    @property
    def compile_count(self) -> int:
        self._compiled.wait_ahead()
        return self._compiled.trace_count

    def close(self) -> None:
        self._compiled.close()

    def keep_on_mesh(self, state: Any) -> None:
        """With a mesh, constrains every new state to the shardings `state` has."""
        if self._placement is not None and self._compiled.state_constraint is None:
            self._compiled.state_constraint = _sharding.constrain(self._placement.state_shardings(state))

    def plan(self, batch: Any, requests: Requests, wanted: dict | None,
             length: int) -> tuple[Any, _fetches.FetchPlan, list[list]]:
        """The batch with the hooks' feeds merged in, the run's fetch plan, and the
        entries (of `requests`) of the hooks that fetch, in the plan's order."""
        fetching, specs = [], []  # the entries of the hooks that fetch, and (hook, fetches) of each
        if requests.asking:
            feeds = [(entry[0], args.feeds) for entry, args in requests.asking if args.feeds]
            if length > 1 and isinstance(batch, list):  # batches on the device: the value in each
                batch = [merge_feeds(item, feeds) for item in batch]
            else:
                if length > 1:  # one value for every step of the run
                    feeds = [(hook, {k: np.broadcast_to(np.asarray(v), (length, *np.shape(v))) for k, v in f.items()})
                             for hook, f in feeds]
                batch = merge_feeds(batch, feeds)
            for entry, args in requests.asking:
                if args.fetches is not None:
                    fetching.append(entry)
                    specs.append((entry[0], _fetches.normalize(args.fetches, entry[0])))
        if specs:
            plan = _fetches.FetchPlan([("run(fetches=...)", wanted), *specs])
        elif wanted is not None:
            plan = _fetches.FetchPlan([("run(fetches=...)", wanted)])
        else:
            plan = NOTHING_FETCHED
        return batch, plan, fetching

    def __call__(self, state: Any, batch: Any, plan: _fetches.FetchPlan, length: int,
                 step: int, unfed: Any = None) -> tuple[Any, Any, tuple]:
        """Dispatches the run of `length` steps after `step`; returns `(new_state,
        outputs, fetched)`. `unfed` is `batch` before `plan` merged the hooks' feeds."""
        if self._placement is not None:
            batch = self._placement.place_batch(batch)
        monitors, self._compiled.step = self._monitors, step
        try:
            if monitors is None:
                state, outputs, fetched = self._compiled(plan.key, state, batch, plan.owners, length, unfed=unfed)
            else:
                if monitors.carry is None:  # the first run since the state was created
                    monitors.prepare(self._compiled.step_fn, state, batch, length,
                                     _carry_sharding(state, self._placement))
                state, outputs, fetched, monitors.carry = self._compiled(plan.key, state, batch, plan.owners,
                                                                         length, monitors.carry, unfed)
        except Exception as error:  # on the trace of a new program only: raising costs nothing before
            if self._placement is not None and type(error).__name__ == "ShardingTypeError":
                note = _sharding.explicit_axes_note(self._placement.mesh)
                if note is not None:
                    error.add_note(note)
            raise
        if self.max_dispatch_ahead is not None:
            self._bound(state, outputs, step)
        self.last_run, self._last_length = (batch, outputs), length
        return state, outputs, fetched

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
        batch, outputs = self.last_run
        if self._last_length > 1:  # the last step's batch of a multi-step run
            batch = batch[-1] if isinstance(batch, list) else jax.tree.map(lambda x: x[-1], batch)
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


def merge_feeds(batch: Any, feeds: list[tuple[Hook, Mapping[str, Any]]]) -> Any:
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
            f"Hooks feed {sorted(merged)}, but the batch is a {type(batch).__name__}, not a "
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
