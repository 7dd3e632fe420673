"""Fetch requests: normalising them and routing one run's values to each requester."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from jaxmon._base.paths import flatten

FetchSpec = str | Callable[..., Any]
_HINT = ("fetches are an output name, a callable fn(state, batch, outputs), a list of them, or a dict "
         "{result_name: name or fn}")


class Wanted(dict):
    """A normalised fetch request: `{result_name: spec}`, with the structure the
    requester gets its values in, as TF did: a name or a callable gives its value, a
    list a list, a dict a dict (`shape` None)."""

    shape: tuple[str, Any] | None = None

    @property
    def key(self) -> tuple:
        """What was asked, as a hashable value: equal requests give equal keys."""
        kind, names = self.shape or (None, None)
        return tuple(self.items()), kind, tuple(names) if isinstance(names, list) else names

    def shaped(self, values: dict[str, Any]) -> Any:
        """`values` (by result name) in the structure asked."""
        if self.shape is None:
            return values
        kind, names = self.shape
        return values[names] if kind == "one" else [values[name] for name in names]


def normalize(fetches: Any, owner: object) -> Wanted | None:
    """Returns `fetches` as a `Wanted` `{result_name: spec}`, or None when nothing is asked.

    Args:
      fetches: what a hook or the caller asked for (see `RunArgs.fetches`).
      owner: who asked (a hook, or a str); formatted only in error messages, so that
        a hook's `repr` never runs (and never reads the device) on a good run.
    """
    if fetches is None or isinstance(fetches, Wanted):
        return fetches
    if isinstance(fetches, str) or callable(fetches):
        name = fetches if isinstance(fetches, str) else "value"
        wanted = Wanted({name: _check_spec(name, fetches, owner)})
        wanted.shape = ("one", name)
        return wanted
    if isinstance(fetches, Mapping):
        for name, spec in fetches.items():
            if not isinstance(name, str):
                raise TypeError(f"{owner}: fetch result names must be str; got {name!r}. {_HINT}.")
            _check_spec(name, spec, owner)
        return Wanted(fetches)
    if isinstance(fetches, Sequence):
        names = [spec if isinstance(spec, str) else f"[{i}]" for i, spec in enumerate(fetches)]
        wanted = Wanted({name: _check_spec(name, spec, owner) for name, spec in zip(names, fetches, strict=True)})
        wanted.shape = ("list", names)
        return wanted
    raise TypeError(f"{owner}: cannot fetch {fetches!r}. {_HINT}.")


def _check_spec(name: str, spec: Any, owner: object) -> FetchSpec:
    if not (isinstance(spec, str) or callable(spec)):
        raise TypeError(f"{owner}: fetch {name!r} is {spec!r}, which is neither an output name nor a callable. "
                        f"{_HINT}.")
    if not isinstance(spec, str) and getattr(type(spec), "__hash__", None) is None:
        raise TypeError(
            f"{owner}: fetch {name!r} is an unhashable callable ({type(spec).__name__}); fetch callables "
            "key the compile cache, so they must be hashable: use a function, or define __hash__."
        )
    return spec


class FetchPlan:
    """The distinct fetches of one run, and which requester gets which value.

    Output names are read from the step's outputs as they are; only callables are
    traced into the compiled step. `key` is the sorted tuple of distinct callables:
    equal sets give equal keys, whoever asked and in whatever order, so they share
    one compiled variant, and fetching output names never compiles anything.
    """

    def __init__(self, requests: Sequence[tuple[object, Wanted | None]]):
        self._requests = requests
        self.owners: dict[FetchSpec, object] = {}
        for owner, request in requests:
            for spec in request.values() if request else ():
                self.owners.setdefault(spec, owner)
        self.key: tuple[Callable[..., Any], ...] = tuple(
            sorted((spec for spec in self.owners if not isinstance(spec, str)), key=lambda spec: (hash(spec), id(spec)))
        )
        # Nobody asked anything (most runs): the same answer every time, made once (a tuple: no caller changes it).
        self._nothing = (None,) * len(requests) if all(r is None for _, r in requests) else None

    def route(self, outputs: Mapping[str, Any], fetched: Sequence[Any]) -> Sequence[Any]:
        """Each requester's values (device arrays) in the structure it asked, None for
        those that asked none."""
        if self._nothing is not None:
            return self._nothing
        values = dict(zip(self.key, fetched, strict=True))
        for spec, owner in self.owners.items():
            if isinstance(spec, str):
                values[spec] = output(outputs, spec, owner)
        return [
            None if request is None else request.shaped({name: values[spec] for name, spec in request.items()})
            for _, request in self._requests
        ]


def output(outputs: Mapping[str, Any], name: str, owner: object) -> Any:
    """The output `name`: a key of `outputs`, or the path of a nested one
    (`"grads/conv1/w"`, or `"grads"` for the whole sub-dict)."""
    if name in outputs:
        return outputs[name]
    value: Any = outputs
    for part in name.split("/"):
        if not isinstance(value, Mapping) or part not in value:
            raise ValueError(
                f"{owner} fetches {name!r}, which is not an output of the step function; its outputs are "
                f"{sorted(paths(outputs))}. Fetch one of those names (a nested output by its path, or a "
                "sub-dict by its prefix), or a callable fn(state, batch, outputs).")
        value = value[part]
    return value


def paths(outputs: Mapping[str, Any]) -> dict[str, Any]:
    """Every leaf of (nested) `outputs` by its path joined with "/"."""
    return flatten(outputs, "/")
