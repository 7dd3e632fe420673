"""One run's requests and values as immutable records: the hooks' `RunPlan` in (built by
`hook_runner.HookRunner`), one `RunResult` out (of `dispatch.Dispatch`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from jaxmon._base.fetches import FetchPlan, Wanted
from jaxmon._base.hook import Hook, RunContext

#: Who the caller's fetches are, in a fetch plan and in its errors.
CALLER = "run(fetches=...)"


class Call(NamedTuple):
    """One hook's part in a run: its `after_run` follows (`late`: one run later; `away`:
    then on the report thread), with the values of its `fetches` and, if it `read`s, its
    accumulators. Equal calls (the same hook asking the same) are equal values."""

    hook: Hook
    late: bool = False
    fetches: Wanted | None = None
    read: bool = False
    away: bool = False


class RunPlan(NamedTuple):
    """What the hooks asked of one run, in hook order.

    Attributes:
      ctx: the run's context (None for a run that calls no hook).
      calls: the hooks whose `after_run` follows this run.
      feeds: `(hook, feeds)` of the hooks that feed the batch.
      readers: the hooks that read their accumulators after this run.
      keeps: those of `readers` whose windows go on (`RunArgs(restart=False)`).
      now, late, away, fetching: the indices in `calls` of those called after this run,
        of those called one run later on the loop, and on the report thread, and of
        those that fetch.
      fetches: the hooks' fetches as one fetch plan (the caller's slot first, empty).
    """

    ctx: RunContext | None
    calls: tuple[Call, ...] = ()
    feeds: tuple[tuple[Hook, Mapping[str, Any]], ...] = ()
    readers: tuple[Hook, ...] = ()
    keeps: tuple[Hook, ...] = ()
    now: tuple[int, ...] = ()
    late: tuple[int, ...] = ()
    away: tuple[int, ...] = ()
    fetching: tuple[int, ...] = ()
    fetches: FetchPlan | None = None

    @classmethod
    def of(cls, ctx: RunContext | None, calls: Sequence[Call],
           feeds: tuple[tuple[Hook, Mapping[str, Any]], ...] = (), only_read: Sequence[Hook] = (),
           keeps: Sequence[Hook] = ()) -> RunPlan:
        """The plan of `calls`, everything else derived from them; `only_read`: hooks that
        read their accumulators but get no call (no `after_run`); `keeps`: the readers
        whose windows go on."""
        calls = tuple(calls)
        readers = (*(call.hook for call in calls if call.read), *only_read)
        fetching = tuple(i for i, call in enumerate(calls) if call.fetches is not None)
        plan = cls(ctx, calls, feeds, readers, tuple(keeps),
                   now=tuple(i for i, call in enumerate(calls) if not call.late),
                   late=tuple(i for i, call in enumerate(calls) if call.late and not call.away),
                   away=tuple(i for i, call in enumerate(calls) if call.away),
                   fetching=fetching)
        return plan._replace(fetches=plan.fetch_plan(None))

    def fetch_plan(self, wanted: Wanted | None) -> FetchPlan:
        """The run's fetch plan with the caller's fetches (`wanted`) first (the hooks'
        alone: kept as `fetches`)."""
        if wanted is None and self.fetches is not None:
            return self.fetches
        return FetchPlan([(CALLER, wanted), *[(self.calls[i].hook, self.calls[i].fetches) for i in self.fetching]])


#: The plan of a run that every hook sleeps through: no event is called.
QUIET = RunPlan(None)


class RunResult(NamedTuple):
    """What one dispatch returns: the new state, the outputs (device arrays), the
    caller's fetches and, for each call of the plan, its fetched values (on the
    device; None where it fetched nothing; empty where no call fetched)."""

    state: Any
    outputs: Any
    caller: Any = None
    results: tuple[Any, ...] = ()
