"""The compiled step: the user's step function jitted once per fetch set."""

from __future__ import annotations

import inspect
import logging
import numbers
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxmon._batches import stack_leaves
from jaxmon._fetches import FetchSpec, paths

logger = logging.getLogger("jaxmon")

#: More compiled variants than this suggests a fetch set that changes every run.
VARIANT_WARNING = 8


def check_step_fn(step_fn: Any) -> None:
    """Raises a `TypeError` unless `step_fn` can be called as `step_fn(state, batch)`."""
    if not callable(step_fn):
        raise TypeError(
            f"step_fn must be a function step_fn(state, batch) -> (new_state, outputs); got {step_fn!r}."
        )
    try:
        signature = inspect.signature(step_fn)
    except (TypeError, ValueError):  # builtins and some C callables: trust them
        return
    try:
        signature.bind(None, None)
    except TypeError:
        name = getattr(step_fn, "__qualname__", repr(step_fn))
        raise TypeError(
            f"step_fn must take two positional arguments (state, batch); {name}{signature} "
            f"does not. Give it the signature step_fn(state, batch) -> (new_state, outputs)."
        ) from None


class CompiledStep:
    """Jits `step_fn` with each distinct set of fetch callables traced into the same program.

    Calling it with a key (a tuple of callables) returns `(new_state, outputs,
    fetched)` where `fetched` holds one value per callable. Each key is compiled once
    (and again only if the shapes of the state or batch change); `trace_count` counts
    every trace, so tests can assert that nothing recompiles by accident.
    `evaluate` computes fetches on a given state, batch and outputs without a step.
    """

    def __init__(self, step_fn: Callable[..., Any], *, donate_state: bool = True):
        check_step_fn(step_fn)
        self.step_fn = step_fn
        self._donate = (0,) if donate_state else ()
        self._variants: dict[tuple[FetchSpec, ...], Callable[..., Any]] = {}
        self._evaluators: dict[tuple[FetchSpec, ...], Callable[..., Any]] = {}
        self.trace_count = 0
        #: The session's `_monitors.Monitors` when some hook has accumulators: their
        #: update is traced into every step. Set before the first call.
        self.monitors: Any = None
        #: Applied to the new state inside the step (a sharded session keeps the state
        #: on its shardings with it); set before the first call.
        self.state_constraint: Callable[[Any], Any] | None = None

    def __call__(self, key: tuple[FetchSpec, ...], state: Any, batch: Any, owners: Mapping[FetchSpec, object],
                 length: int = 1, carry: Any = None):
        """One dispatch: one step, or with `length` > 1 that many steps scanned over
        the leading axis of `batch` (outputs and fetches of the last step). With
        `monitors` set, `carry` is their accumulators before the run; the call then
        returns `(new_state, outputs, fetched, new_carry)`."""
        variant = self._variants.get((key, length))
        if variant is None:
            variant = self._variants[key, length] = self._build(key, dict(owners), length)
            if len(self._variants) > VARIANT_WARNING and len({k for k, _ in self._variants}) == VARIANT_WARNING + 1:
                logger.warning(
                    "The step is now compiled for %d distinct fetch sets. A hook probably "
                    "fetches a new callable each run (e.g. a lambda made in before_run): "
                    "create the callable once and pass the same object every run.",
                    len({k for k, _ in self._variants}),
                )
        return variant(state, batch, carry)

    def _build(self, key: tuple[FetchSpec, ...], owners: dict[FetchSpec, object], length: int) -> Callable[..., Any]:
        monitors = self.monitors

        def one_step(state, carry, batch):
            new_state, outputs = _check_result(self.step_fn(state, batch), state)
            if carry is not None:
                carry, new_state = monitors.update(carry, state, new_state, batch, outputs)
            if self.state_constraint is not None:
                new_state = self.state_constraint(new_state)
            return new_state, carry, outputs

        def scanned(both, batch):
            state, carry, outputs = one_step(*both, batch)
            return (state, carry), outputs

        def variant(state, batch, carry):
            if length == 1:
                new_state, carry, outputs = one_step(state, carry, batch)
            else:  # the last step's batch and outputs are what fetches see, as after one step
                if isinstance(batch, list):  # batches on the device, stacked inside this program
                    batch = stack_leaves(batch)
                (new_state, carry), stacked = jax.lax.scan(scanned, (state, carry), batch, length=length)
                batch, outputs = jax.tree.map(lambda x: x[-1], (batch, stacked))
            fetched = tuple(_evaluate(spec, owners[spec], new_state, batch, outputs) for spec in key)
            self.trace_count += 1  # a trace that raised compiles nothing
            if carry is None:
                return new_state, outputs, fetched
            return new_state, outputs, fetched, carry

        return jax.jit(variant, donate_argnums=self._donate)

    def evaluate(self, key: tuple[FetchSpec, ...], state: Any, batch: Any, outputs: Any, owners: Mapping) -> tuple:
        """The fetch callables of `key` on `(state, batch, outputs)`, jitted once per key."""
        if not key:
            return ()
        evaluator = self._evaluators.get(key)
        if evaluator is None:
            owners = dict(owners)

            def evaluator(state, batch, outputs):
                return tuple(_evaluate(spec, owners[spec], state, batch, outputs) for spec in key)

            evaluator = self._evaluators[key] = jax.jit(evaluator)
        return evaluator(state, batch, outputs)


def _evaluate(spec: Callable[..., Any], owner: object, state: Any, batch: Any, outputs: Mapping[str, Any]) -> Any:
    try:
        return spec(state, batch, outputs)
    except Exception as error:
        error.add_note(f"(in the fetch {spec!r} of {owner})")
        raise


def _is_array(value: Any) -> bool:
    return isinstance(value, (jax.Array, np.ndarray, np.generic, numbers.Number))


def _check_result(result: Any, state: Any) -> tuple[Any, dict[str, Any]]:
    """Checks (on trace) that the step returned `(new_state, {name: array})`."""
    if not (isinstance(result, tuple) and len(result) == 2):
        raise TypeError(
            f"step_fn must return a pair (new_state, outputs); it returned {_describe(result)}."
        )
    new_state, outputs = result
    if not _str_keys(outputs):
        raise TypeError(
            f"step_fn's outputs must be a dict of arrays such as {{'loss': loss}} (dicts may nest); "
            f"it returned {_describe(outputs)}."
        )
    bad = {k: _describe(v) for k, v in paths(outputs).items() if not _is_array(v)}
    if bad:
        raise TypeError(
            f"step_fn's outputs must be a dict of arrays such as {{'loss': loss}} (dicts may nest); "
            f"these entries are not arrays: {bad}. Return arrays (or scalars) only."
        )
    _check_same_state(state, new_state)
    return new_state, dict(outputs)


def _str_keys(outputs: Any) -> bool:
    """Whether `outputs` is a dict with str keys, and so is every dict in it."""
    return isinstance(outputs, Mapping) and all(
        isinstance(k, str) and (not isinstance(v, Mapping) or _str_keys(v)) for k, v in outputs.items())


def _check_same_state(state: Any, new_state: Any) -> None:
    old, new = jax.tree.structure(state), jax.tree.structure(new_state)
    if old != new:
        raise TypeError(
            "step_fn returned a new state with another structure than the state it was "
            f"given (given {old}, returned {new}). Return the same pytree with new values, "
            "e.g. state.replace(...) or state.apply_gradients(grads=...)."
        )
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(state), jax.tree.leaves(new_state), strict=True):
        before, after = (jnp.shape(a), jnp.result_type(a)), (jnp.shape(b), jnp.result_type(b))
        if before != after:
            raise TypeError(
                f"step_fn changed the shape or dtype of state{jax.tree_util.keystr(path)} "
                f"from {before} to {after}; every step would recompile. Keep each leaf's "
                "shape and dtype (cast with .astype if needed)."
            )


def _describe(value: Any) -> str:
    if isinstance(value, (jax.Array, np.ndarray)):
        return f"an array {_short(value)}"
    if isinstance(value, (tuple, list)):
        return f"a {type(value).__name__} of {len(value)}: ({', '.join(_short(v) for v in value)})"
    if isinstance(value, Mapping):
        return f"a {type(value).__name__} with keys {list(value)}"
    return f"a {type(value).__name__} ({value!r:.60})"


def _short(value: Any) -> str:
    if isinstance(value, (jax.Array, np.ndarray)):
        return f"{value.dtype}{list(value.shape)}"
    return type(value).__name__
