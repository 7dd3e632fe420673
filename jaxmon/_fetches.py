"""Fetch requests: normalising them and routing one compiled result to each requester."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

FetchSpec = str | Callable[..., Any]
_HINT = "fetches are an output name, a list of names, or a dict {result_name: name or fn(state, batch, outputs)}"


def normalize(fetches: Any, owner: object) -> dict[str, FetchSpec] | None:
    """Returns `fetches` as `{result_name: spec}`, or None when nothing is asked.

    Args:
      fetches: what a hook or the caller asked for (see `RunArgs.fetches`).
      owner: who asked (a hook, or a str); formatted only in error messages, so that
        a hook's `repr` never runs (and never reads the device) on a good run.
    """
    if fetches is None:
        return None
    if isinstance(fetches, str):
        return {fetches: fetches}
    if isinstance(fetches, Mapping):
        for name, spec in fetches.items():
            if not isinstance(name, str):
                raise TypeError(f"{owner}: fetch result names must be str; got {name!r}. {_HINT}.")
            if not (isinstance(spec, str) or callable(spec)):
                raise TypeError(
                    f"{owner}: fetch {name!r} is {spec!r}, which is neither an output name nor a callable. {_HINT}."
                )
            if not isinstance(spec, str) and getattr(type(spec), "__hash__", None) is None:
                raise TypeError(
                    f"{owner}: fetch {name!r} is an unhashable callable ({type(spec).__name__}); fetch callables "
                    "key the compile cache, so they must be hashable: use a function, or define __hash__."
                )
        return dict(fetches)
    if callable(fetches):
        raise TypeError(f"{owner}: a callable fetch needs a result name: fetches={{'name': fn}}. {_HINT}.")
    if isinstance(fetches, Sequence) and all(isinstance(name, str) for name in fetches):
        return {name: name for name in fetches}
    raise TypeError(f"{owner}: cannot fetch {fetches!r}. {_HINT}.")


def _order(spec: FetchSpec) -> tuple[int, str, int]:
    return (0, spec, 0) if isinstance(spec, str) else (1, "", hash(spec))


class FetchPlan:
    """The distinct fetches of one run, and which requester gets which value.

    `key` is the sorted tuple of distinct specs: equal fetch sets give equal keys,
    whoever asked and in whatever order, so they share one compiled variant.
    """

    def __init__(self, requests: Sequence[tuple[object, dict[str, FetchSpec] | None]]):
        self._size = len(requests)
        self.owners: dict[FetchSpec, object] = {}
        for owner, request in requests:
            for spec in request.values() if request else ():
                self.owners.setdefault(spec, owner)
        if not self.owners and all(request is None for _, request in requests):
            self.key: tuple[FetchSpec, ...] = ()  # the common case: nobody fetches
            self._routes = None
            return
        self.key = tuple(sorted(self.owners, key=_order))
        index = {spec: i for i, spec in enumerate(self.key)}
        self._routes = [
            None if request is None else {name: index[spec] for name, spec in request.items()}
            for _, request in requests
        ]

    def route(self, values: Sequence[Any]) -> list[dict[str, Any] | None]:
        """Splits the values computed for `key` into one result dict per requester."""
        if self._routes is None:
            return [None] * self._size
        return [
            None if route is None else {name: values[i] for name, i in route.items()}
            for route in self._routes
        ]
