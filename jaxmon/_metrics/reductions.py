"""Reductions over steps as values: `Mean`, `Sum`, `Ratio`, `Last`, `FirstNonFinite`,
and `.then(fn)` for a transform on the host. Each is a spec (what to reduce) with pure
functions of an immutable accumulator (`init`, `update`, `result`), which the session
runs inside the compiled step (see `Hook.accumulators`)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxmon._base.fetches import normalize, paths


def check_reduce(owner: str, reduce: object) -> str:
    """`reduce` if it is "mean" or "last", else a `ValueError` naming `owner`."""
    if reduce not in ("mean", "last"):
        raise ValueError(f"{owner} reduce must be 'mean' (the mean since the last write, the default) or 'last' "
                         f"(the value at the write step, as TF); got {reduce!r}.")
    return reduce


def _spec(fetch: Any, owner: str) -> Any:
    """A fetch as a reduction keeps it: a callable, a name, a tuple of names, or None."""
    if fetch is None or callable(fetch):
        return fetch
    names = [fetch] if isinstance(fetch, str) else fetch
    normalize(list(names), f"{owner} fetch")
    return fetch if isinstance(fetch, str) else tuple(names)


def _shown(fetch: Any) -> str:
    """A fetch as a reduction's repr shows it: a callable by its name, the same in
    every process (a checkpoint's windows are matched by these reprs), else `repr`."""
    if isinstance(fetch, functools.partial):
        return f"partial({_shown(fetch.func)})"
    if callable(fetch):
        return getattr(fetch, "__qualname__", None) or type(fetch).__qualname__
    return repr(fetch)


def _names(fetch: Any) -> set[str]:
    """The output names a fetch (as `_spec` keeps it) reads."""
    if isinstance(fetch, str):
        return {fetch}
    return set(fetch) if isinstance(fetch, tuple) else set()


def evaluate(fetch: Any, state: Any, batch: Any, outputs: Mapping[str, Any], owner: object) -> Any:
    """One step's value of a reduction's fetch (traced): a callable's result, an output
    by name (a nested one by its path), or `{name: value}` of the scalar outputs named
    (None: every scalar output)."""
    if callable(fetch):
        return fetch(state, batch, outputs)
    flat = paths(outputs)
    if isinstance(fetch, str):
        if fetch not in flat:
            raise ValueError(f"{owner!r} reduces {fetch!r}, which is not an output of the step function; its "
                             f"outputs are {sorted(flat)}. Name one of those, or pass a callable "
                             "fn(state, batch, outputs).")
        return flat[fetch]
    names = flat if fetch is None else [name for name in fetch if name in flat]
    return {name: flat[name] for name in names if jnp.ndim(flat[name]) == 0}


def _zeros(value: Any) -> Any:
    return jax.tree.map(lambda leaf: np.zeros(leaf.shape, np.float32), value)


def of_last_step(reduction: Reduction, session: Any) -> Any:
    """`reduction`'s result over the session's last step alone (its state, batch and
    outputs), computed on the host: what a hook reports at its end."""
    value = session.fetch({"value": reduction.value})["value"]
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype), value)
    acc = reduction.update(reduction.init(shapes), value, np.int32(session.step))
    return reduction.result(jax.device_get(acc), 1)


class Reduction:
    """A reduction over one value per step, computed on the device (see
    `Hook.accumulators`). Subclasses give `init`, `update` and `result`, pure functions
    of an accumulator (a pytree of int32 or float32 arrays); everything in `update`
    runs inside the compiled step, so it uses `jnp` only (no `lax.cond`, no host
    callback: either makes a GPU wait for the host).

    Args:
      fetch: the value of each step: an output name, a list of output names (their
        scalar ones), None (every scalar output), or a callable
        `fn(state, batch, outputs) -> pytree` on the step's new state.

    Example:
      >>> import jaxmon as jm, numpy as np
      >>> perplexity = jm.Ratio("loss_sum", "tokens").then(np.exp)
    """

    def __init__(self, fetch: Any = None):
        self.fetch = _spec(fetch, type(self).__name__)

    def value(self, state: Any, batch: Any, outputs: Mapping[str, Any]) -> Any:
        """This step's value: the fetch, evaluated in the step (traced)."""
        return evaluate(self.fetch, state, batch, outputs, self)

    def reads(self) -> set[str]:
        """The outputs this reduction reads by name (none for a callable fetch or None)."""
        return _names(self.fetch)

    def init(self, value: Any) -> Any:
        """The accumulator before the first step: a pytree of int32 or float32 NumPy
        arrays, given the value's shapes and dtypes (`jax.ShapeDtypeStruct`s)."""
        raise NotImplementedError

    def update(self, acc: Any, value: Any, step: jax.Array) -> Any:
        """The accumulator after a step (traced); `step` is the step number after it."""
        raise NotImplementedError

    def result(self, acc: Any, steps: int) -> Any:
        """What the hook gets from the host copy of `acc`, `steps` steps after a restart."""
        raise NotImplementedError

    def accept(self, acc: Any) -> jax.Array | None:
        """Whether the step's new state is kept (traced, after `update`); None: always."""
        return None

    def then(self, fn: Callable[[Any], Any]) -> Reduction:
        """This reduction with `fn` applied to its result on the host (e.g. `np.exp`
        of a mean loss: the perplexity)."""
        if not callable(fn):
            raise TypeError(f"{self!r}.then(fn) needs a function of the result, e.g. np.exp; got {fn!r}.")
        return Then(self, fn)

    #: Whether a read by the owning hook starts the accumulator afresh (a window), or
    #: it keeps accumulating for the whole session (a sticky flag).
    restarts: bool = True

    def __repr__(self) -> str:
        return f"{type(self).__name__}({_shown(self.fetch)})"


class Mean(Reduction):
    """The mean over the steps since the last read, leaf by leaf: Σ w·v / Σ w in float32.

    Args:
      fetch: as `Reduction`.
      weight: each step's weight (a scalar): an output name or a callable fetch;
        None: every step weighs 1.

    Example:
      >>> import jaxmon as jm
      >>> loss = jm.Mean("loss", weight="tokens")  # a token-weighted mean loss
    """

    def __init__(self, fetch: Any = None, weight: Any = None):
        super().__init__(fetch)
        if weight is not None and not (isinstance(weight, str) or callable(weight)):
            raise TypeError(f"Mean weight must be an output name or a callable fn(state, batch, outputs); "
                            f"got {weight!r}.")
        self.weight = weight

    def value(self, state: Any, batch: Any, outputs: Mapping[str, Any]) -> Any:
        weight = 1.0 if self.weight is None else evaluate(self.weight, state, batch, outputs, self)
        if jnp.size(weight) != 1:
            raise ValueError(f"{self!r} weighs each step by one number; its weight has shape {jnp.shape(weight)}. "
                             "Sum it in the step (e.g. outputs['tokens'] = mask.sum()).")
        return {"value": super().value(state, batch, outputs), "weight": jnp.reshape(weight, ())}

    def reads(self) -> set[str]:
        return super().reads() | _names(self.weight)

    def init(self, value: Any) -> Any:
        if self.weight is None:  # the weight is the window's number of steps: nothing to carry
            return {"total": _zeros(value["value"])}
        return {"total": _zeros(value["value"]), "weight": np.zeros((), np.float32)}

    def update(self, acc: Any, value: Any, step: jax.Array) -> Any:
        weight = jnp.asarray(value["weight"], jnp.float32)
        total = jax.tree.map(lambda total, x: total + weight * jnp.asarray(x, jnp.float32), acc["total"],
                             value["value"])
        return {"total": total} if self.weight is None else {"total": total, "weight": acc["weight"] + weight}

    def result(self, acc: Any, steps: int) -> Any:
        weight = float(acc["weight"]) if self.weight is not None else steps
        return jax.tree.map(lambda total: total / weight if weight else total * np.nan, acc["total"])

    def __repr__(self) -> str:
        weight = "" if self.weight is None else f", weight={_shown(self.weight)}"
        return f"Mean({_shown(self.fetch)}{weight})"


class Sum(Reduction):
    """The sum over the steps since the last read, leaf by leaf (float32)."""

    def init(self, value: Any) -> Any:
        return _zeros(value)

    def update(self, acc: Any, value: Any, step: jax.Array) -> Any:
        return jax.tree.map(lambda total, x: total + jnp.asarray(x, jnp.float32), acc, value)

    def result(self, acc: Any, steps: int) -> Any:
        return acc


class Ratio(Reduction):
    """Σ numerator / Σ denominator over the steps since the last read: e.g. a
    token-weighted loss from a step that outputs the summed loss and the token count.

    Args:
      numerator, denominator: output names or callable fetches.

    Example:
      >>> import jaxmon as jm
      >>> loss = jm.Ratio("loss_sum", "tokens")
    """

    def __init__(self, numerator: Any, denominator: Any):
        super().__init__(None)
        self.numerator = _spec(numerator, "Ratio numerator")
        self.denominator = _spec(denominator, "Ratio denominator")
        for part in (self.numerator, self.denominator):
            if not (isinstance(part, str) or callable(part)):
                raise TypeError(f"Ratio takes an output name or a callable for its numerator and denominator; "
                                f"got Ratio({numerator!r}, {denominator!r}).")

    def value(self, state: Any, batch: Any, outputs: Mapping[str, Any]) -> Any:
        return {part: evaluate(getattr(self, part), state, batch, outputs, self)
                for part in ("numerator", "denominator")}

    def reads(self) -> set[str]:
        return _names(self.numerator) | _names(self.denominator)

    def init(self, value: Any) -> Any:
        return _zeros(value)

    def update(self, acc: Any, value: Any, step: jax.Array) -> Any:
        return jax.tree.map(lambda total, x: total + jnp.asarray(x, jnp.float32), acc, value)

    def result(self, acc: Any, steps: int) -> Any:
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.asarray(acc["numerator"], np.float64) / np.asarray(acc["denominator"], np.float64)

    def __repr__(self) -> str:
        return f"Ratio({_shown(self.numerator)}, {_shown(self.denominator)})"


class Last(Reduction):
    """The value of the last step before the read (integers as int32, the rest float32)."""

    def init(self, value: Any) -> Any:
        return jax.tree.map(lambda leaf: np.zeros(leaf.shape, np.int32 if jnp.issubdtype(leaf.dtype, jnp.integer)
                                                  else np.float32), value)

    def update(self, acc: Any, value: Any, step: jax.Array) -> Any:
        return jax.tree.map(lambda old, x: jnp.asarray(x, old.dtype), acc, value)

    def result(self, acc: Any, steps: int) -> Any:
        return acc


class Then(Reduction):
    """`reduction` with `fn` applied to its result on the host (`Reduction.then`)."""

    def __init__(self, reduction: Reduction, fn: Callable[[Any], Any]):
        self.reduction, self.fn = reduction, fn
        self.fetch = reduction.fetch
        self.restarts = reduction.restarts

    def value(self, state: Any, batch: Any, outputs: Mapping[str, Any]) -> Any:
        return self.reduction.value(state, batch, outputs)

    def reads(self) -> set[str]:
        return self.reduction.reads()

    def init(self, value: Any) -> Any:
        return self.reduction.init(value)

    def update(self, acc: Any, value: Any, step: jax.Array) -> Any:
        return self.reduction.update(acc, value, step)

    def accept(self, acc: Any) -> jax.Array | None:
        return self.reduction.accept(acc)

    def result(self, acc: Any, steps: int) -> Any:
        return self.fn(self.reduction.result(acc, steps))

    def __repr__(self) -> str:
        return f"{self.reduction!r}.then({_shown(self.fn)})"


class FirstNonFinite(Reduction):
    """The first step whose value has a NaN or an infinity, and that value (or, for an
    array, how many of its entries are not finite); sticky for the whole session. With
    `spike_factor`, a finite scalar above that factor times its running average is a
    bad step too (a loss spike), judged on the device like the rest.

    Args:
      fetch: as `Reduction`.
      max_skips: 0 keeps every update; n > 0 keeps the state of the step before a
        bad value instead (with `jnp.where`, on the device), up to n consecutive
        steps: the (n + 1)-th is then the reported step.
      spike_factor: a scalar value above `spike_factor` times the running average of
        the good values before it is a spike (None: no spike rule); for positive
        values, such as a loss. Until the average has warmed up, the level is the first
        good value: a run that diverges in its first steps is caught too.
      spike_warmup: how many good values the running average takes before it judges.
      spike_decay: the running average's decay per good value (an exponential mean
        over about 1 / (1 - decay) values).
    """

    def __init__(self, fetch: Any = "loss", max_skips: int = 0, *, spike_factor: float | None = None,
                 spike_warmup: int = 20, spike_decay: float = 0.99):
        super().__init__(fetch)
        if spike_factor is not None and (isinstance(spike_factor, bool) or not isinstance(spike_factor, (int, float))
                                         or spike_factor <= 1):
            raise ValueError(f"spike_factor must be a number > 1 (a loss above that many times its running "
                             f"average is a spike) or None; got {spike_factor!r}.")
        if not 0 < spike_decay < 1:
            raise ValueError(f"spike_decay must be between 0 and 1; got {spike_decay!r}.")
        self.max_skips, self.spike_factor, self.spike_warmup, self.spike_decay = (
            max_skips, spike_factor, spike_warmup, spike_decay)
        self.size = 1

    restarts = False

    def init(self, value: Any) -> Any:
        self.size = sum(int(np.prod(leaf.shape)) for leaf in jax.tree.leaves(value))
        if self.spike_factor is not None and self.size != 1:
            raise ValueError(f"FirstNonFinite(spike_factor={self.spike_factor}) judges one scalar per step; "
                             f"{self.fetch!r} has {self.size} entries. Fetch a scalar: an output such as the mean "
                             "loss, or a callable `lambda state, batch, outputs: outputs['loss'].mean()`.")
        acc = {"step": np.array(-1, np.int32), "value": np.array(0, np.float32), "run": np.array(0, np.int32),
               "skipped": np.array(0, np.int32)}
        if self.spike_factor is not None:
            acc |= {"spike": np.array(0, np.int32), "mean": np.array(0, np.float32),
                    "weight": np.array(0, np.float32), "seen": np.array(0, np.int32),
                    "first": np.array(0, np.float32)}
        return acc

    def update(self, acc: Any, value: Any, step: jax.Array) -> Any:
        leaves = [jnp.asarray(leaf) for leaf in jax.tree.leaves(value)]
        bad_count = sum(jnp.sum(~jnp.isfinite(leaf)).astype(jnp.int32) for leaf in leaves)
        bad = bad_count > 0
        shown = leaves[0].reshape(-1)[0].astype(jnp.float32) if self.size == 1 else bad_count.astype(jnp.float32)
        new = {}
        if self.spike_factor is not None:  # an exponential mean of the good values, debiased
            average = acc["mean"] / jnp.maximum(acc["weight"], 1e-30)
            warm = acc["seen"] >= self.spike_warmup
            level = jnp.where(warm, average, acc["first"])  # before the warm-up ends: the first good value
            spike = ~bad & (warm | (acc["first"] > 0)) & (shown > self.spike_factor * level)  # first > 0: one good seen
            good, decay = ~bad & ~spike, self.spike_decay
            new = {"mean": jnp.where(good, decay * acc["mean"] + (1 - decay) * shown, acc["mean"]),
                   "weight": jnp.where(good, decay * acc["weight"] + (1 - decay), acc["weight"]),
                   "seen": acc["seen"] + good.astype(jnp.int32),
                   "first": jnp.where(good & (acc["seen"] == 0), shown, acc["first"])}
            bad = bad | spike
        run = jnp.where(bad, acc["run"] + 1, 0)
        fails = bad & (run > self.max_skips) & (acc["step"] < 0)
        if self.spike_factor is not None:
            new["spike"] = jnp.where(fails, spike.astype(jnp.int32), acc["spike"])
        return {"step": jnp.where(fails, step, acc["step"]), "value": jnp.where(fails, shown, acc["value"]),
                "run": run, "skipped": acc["skipped"] + (bad & ~fails & (acc["step"] < 0)).astype(jnp.int32), **new}

    def accept(self, acc: Any) -> jax.Array | None:
        if not self.max_skips:
            return None
        return (acc["run"] == 0) | (acc["step"] >= 0)

    def result(self, acc: Any, steps: int) -> Any:
        step = int(acc["step"])
        value = float(acc["value"]) if self.size == 1 else f"{int(acc['value'])} of {self.size} entries non-finite"
        spike = {} if self.spike_factor is None else {"spike": bool(acc["spike"])}
        return {"step": None if step < 0 else step, "value": value, "skipped": int(acc["skipped"]), **spike}
