"""One run's requests and values as immutable records: the hooks' `RunPlan` in (built by
`_hook_runner.HookRunner`), one `RunResult` out (of `_dispatch.Dispatch`)."""

from __future__ import annotations

from collections.abc import Container, Mapping, Sequence
from typing import Any, NamedTuple

from jaxmon._base.hook import Hook, RunContext
from jaxmon._run.fetches import Wanted


class Call(NamedTuple):
    """One hook's part in a run: its `after_run` follows (`late`: one run later; `away`:
    then on the report thread), with the values of its `fetches` and, if it `read`s, its
    accumulators."""

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
      now, late, away, fetching: the indices in `calls` of those called after this run,
        of those called one run later on the loop, and on the report thread, and of
        those that fetch.
      fetch_now: whether a call made after this run fetches.
    """

    ctx: RunContext | None
    calls: tuple[Call, ...] = ()
    feeds: tuple[tuple[Hook, Mapping[str, Any]], ...] = ()
    readers: tuple[Hook, ...] = ()
    now: tuple[int, ...] = ()
    late: tuple[int, ...] = ()
    fetching: tuple[int, ...] = ()
    away: tuple[int, ...] = ()
    fetch_now: bool = False

    @classmethod
    def of(cls, ctx: RunContext | None, calls: tuple[Call, ...],
           feeds: tuple[tuple[Hook, Mapping[str, Any]], ...] = (), without: Container[int] = ()) -> RunPlan:
        """The plan of `calls`, its readers and indices derived; the calls of hooks
        numbered (by `id`) in `without` only read (they have no `after_run`)."""
        readers = tuple(call.hook for call in calls if call.read)
        calls = tuple(call for call in calls if call.fetches is not None or id(call.hook) not in without)
        return cls(ctx, calls, feeds, readers, tuple(i for i, call in enumerate(calls) if not call.late),
                   tuple(i for i, call in enumerate(calls) if call.late and not call.away),
                   tuple(i for i, call in enumerate(calls) if call.fetches is not None),
                   tuple(i for i, call in enumerate(calls) if call.away),
                   any(not call.late and call.fetches is not None for call in calls))


#: The plan of a run that every hook sleeps through: no event is called.
QUIET = RunPlan(None)


class NoResults:
    """The results of a run in which no call fetched anything: None for every call."""

    def __getitem__(self, i: int) -> None:
        return None


NO_RESULTS = NoResults()


class RunResult(NamedTuple):
    """What one dispatch returns: the new state, the outputs (device arrays), the
    caller's fetches and, for each call of the plan, its fetched values (on the
    device; None where it fetched nothing; a `_fetches.Routed` routes them when
    first asked for)."""

    state: Any
    outputs: Any
    caller: Any = None
    results: Sequence[Any] = ()
