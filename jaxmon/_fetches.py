"""Fetch requests: normalising them and routing one run's values to each requester."""

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


class FetchPlan:
    """The distinct fetches of one run, and which requester gets which value.

    Output names are read from the step's outputs as they are; only callables are
    traced into the compiled step. `key` is the sorted tuple of distinct callables:
    equal sets give equal keys, whoever asked and in whatever order, so they share
    one compiled variant, and fetching output names never compiles anything.
    """

    def __init__(self, requests: Sequence[tuple[object, dict[str, FetchSpec] | None]]):
        self._requests = requests
        self.owners: dict[FetchSpec, object] = {}
        for owner, request in requests:
            for spec in request.values() if request else ():
                self.owners.setdefault(spec, owner)
        self.key: tuple[Callable[..., Any], ...] = tuple(
            sorted((spec for spec in self.owners if not isinstance(spec, str)), key=hash)
        )
        # Nobody asked anything (most runs): the same answer every time, made once.
        self._nothing = [None] * len(requests) if all(r is None for _, r in requests) else None

    def route(self, outputs: Mapping[str, Any], fetched: Sequence[Any]) -> list[dict[str, Any] | None]:
        """One result dict (device values) per requester, None for those that asked none."""
        if self._nothing is not None:
            return self._nothing
        if not self.owners:  # the common case: nobody fetches
            return [None if request is None else {} for _, request in self._requests]
        values = dict(zip(self.key, fetched, strict=True))
        for spec, owner in self.owners.items():
            if isinstance(spec, str):
                if spec not in outputs:
                    raise ValueError(
                        f"{owner} fetches {spec!r}, which is not an output of the step function; "
                        f"its outputs are {sorted(outputs)}. Fetch one of those names, or a callable "
                        f"fn(state, batch, outputs)."
                    )
                values[spec] = outputs[spec]
        return [
            None if request is None else {name: values[spec] for name, spec in request.items()}
            for _, request in self._requests
        ]
