"""How the `lax.scan` of a multi-step run is compiled: the session's `scan_unroll`.

XLA's CPU backend puts only the convolutions of a program's top level into the layout
its fast (Eigen) kernel takes; one inside a loop body, such as the gradient's
convolutions in the body of a scan, runs as a generic loop nest. Measured on 2 CPU
cores (JAX 0.10.2, `benchmarks/scan_unroll.py`, figures in `benchmarks/RESULTS.md`), the
digits CNN of `configs/default.py` at batch 64 took 5.6 ms a step called one at a time,
76 ms a step in a scan of 8 or 32 (unrolling by 2 or 4 keeps the loop: no change), and
fully unrolled 5.5 ms (8 steps, 6.4 s to compile against 2.2 s) or 6.6 ms (32 steps,
31 s to compile). The MLP of `benchmarks/core_overhead.py`, without convolutions, runs
well in a CPU loop (63 us a step against 110 one at a time) and worse unrolled (104 us,
136 us for 32 steps). "auto" therefore keeps the loop and, on CPU, rewrites the step's
convolutions into that layout itself (`canonical_convolutions`): 5.3-5.5 ms a step, the
compile time of one step (2.0-2.2 s), and bit for bit the results of one step per run.
On GPU and TPU, XLA runs loops well: "auto" is a plain loop there.

How many programs a session compiles differs too. On CPU, "auto" compiles one program
per fetch set for every run of up to `steps_per_dispatch` steps, the run's length an
argument of its loop (`dynamic_length`): compiling is the CPU's own work there, taken
from the training (each program of the CNN took 2 s of the 2 cores, and one program
per power-of-two run length made `steps_per_dispatch=8` slower than 1). Elsewhere a loop
whose trip count is only known on the device reads its condition back to the host at
every iteration on GPU, so each power-of-two length gets its own program, compiled ahead
on host cores the device leaves idle.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
from jax.extend import core

#: The choices of `scan_unroll`, as error messages name them.
CHOICES = '"auto", True (fully unrolled) or an int >= 1 (1: a loop)'

CONVOLUTION = "conv_general_dilated"
#: Primitives that call a jaxpr with the same inputs and outputs as their own; one that
#: holds a convolution is evaluated inline so that its convolutions are rewritten too.
_CALLS = {"jit": "jaxpr", "pjit": "jaxpr", "closed_call": "call_jaxpr", "core_call": "call_jaxpr",
          "remat2": "jaxpr", "checkpoint": "jaxpr", "custom_jvp_call": "call_jaxpr", "custom_vjp_call": "call_jaxpr"}


class Scan(NamedTuple):
    """How a run's `lax.scan` is compiled: its `unroll`, and whether the step's
    convolutions are rewritten into the form XLA's CPU kernel takes."""

    unroll: int | bool
    canonical: bool = False


def check_scan_unroll(value: Any) -> None:
    """Raises a `TypeError` or `ValueError` naming `value` unless it is a choice of `scan_unroll`."""
    if value is True or isinstance(value, str) and value == "auto":
        return
    if isinstance(value, str) or value is False:
        raise ValueError(f"scan_unroll must be {CHOICES}; got {value!r}.")
    if not isinstance(value, int):
        raise TypeError(f"scan_unroll must be {CHOICES}; got {value!r} of type {type(value).__name__}.")
    if value < 1:
        raise ValueError(f"scan_unroll must be {CHOICES}; got {value!r}.")


def resolve_scan_unroll(value: Any, platform: str, convolution: bool) -> Scan:
    """How to compile the scan of a run of several steps.

    Args:
      value: the session's `scan_unroll` (checked by `check_scan_unroll`).
      platform: the platform of the state's devices ("cpu", "gpu", "tpu"; see `platform_of`).
      convolution: whether the step convolves (see `convolves`).

    Returns:
      `Scan(value)` unless `value` is "auto"; "auto": a loop (`unroll=1`), with the
      convolutions rewritten (`canonical`) for a step that convolves on "cpu".
    """
    if not (isinstance(value, str) and value == "auto"):
        return Scan(value)
    return Scan(1, canonical=platform == "cpu" and convolution)


def dynamic_length(value: Any, platform: str) -> bool:
    """Whether runs of several steps share one program whose loop length is an
    argument: with "auto" on CPU (see the module's notes)."""
    return isinstance(value, str) and value == "auto" and platform == "cpu"


def platform_of(state: Any) -> str:
    """The platform of the devices of `state`'s first array, or of JAX's default backend
    when it holds none (numbers, NumPy arrays)."""
    for leaf in jax.tree.leaves(state):
        sharding = getattr(leaf, "sharding", None) if isinstance(leaf, jax.Array) else None
        if sharding is not None:
            return next(iter(sharding.device_set)).platform
    return jax.default_backend()


def convolves(step_fn: Callable[..., Any], state: Any, batch: Any) -> bool:
    """Whether `step_fn(state, batch)` (abstract values) holds a convolution, in its
    gradient or any function it calls included. A step that cannot be traced here gives
    False: its own compilation then raises the error, with the session's notes."""
    try:
        jaxpr = jax.make_jaxpr(step_fn)(state, batch).jaxpr
    except Exception:  # noqa: BLE001 - raised again, where it belongs, by the step's compilation
        return False
    return _holds_convolution(jaxpr)


def canonical_convolutions(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn` with every convolution it computes (its gradient's included) as a
    convolution in the layout XLA's CPU kernel takes (batch, spatial..., feature input;
    spatial..., in, out kernel), between transposes: what XLA does itself for the
    convolutions of a program's top level, done for those in a loop body too. The same
    numbers, bit for bit; convolutions with an explicit output sharding, and those
    inside a loop or a branch of `fn`, are left as they are."""
    def canonical(*args):
        try:
            closed, shapes = jax.make_jaxpr(fn, return_shape=True)(*args)
        except Exception:  # noqa: BLE001 - what `fn` returns or raises itself, without the rewrite
            return fn(*args)
        results = _evaluate(closed.jaxpr, closed.consts, jax.tree.leaves(args))
        return jax.tree.unflatten(jax.tree.structure(shapes), results)

    return canonical


def _holds_convolution(jaxpr: Any) -> bool:
    return any(equation.primitive.name == CONVOLUTION
               or any(_holds_convolution(inner) for inner in core.jaxprs_in_params(equation.params))
               for equation in jaxpr.eqns)


def _evaluate(jaxpr: Any, consts: Sequence[Any], args: Sequence[Any]) -> list[Any]:
    """`jaxpr` on `args`, each equation bound again as `jax.core.eval_jaxpr` does, but
    convolutions made canonical and calls that hold one evaluated inline."""
    env: dict[Any, Any] = dict(zip(jaxpr.constvars, consts, strict=True))
    env.update(zip(jaxpr.invars, args, strict=True))

    def read(atom):
        return atom.val if isinstance(atom, core.Literal) else env[atom]

    for equation in jaxpr.eqns:
        values = [read(atom) for atom in equation.invars]
        results = _rewritten(equation, values)
        if results is None:
            params = equation.primitive.get_bind_params(equation.params)
            manager = getattr(getattr(equation, "ctx", None), "manager", None) or contextlib.nullcontext()
            with manager:
                results = equation.primitive.bind(*values, **params)
            if not equation.primitive.multiple_results:
                results = [results]
        env.update(zip(equation.outvars, results, strict=True))
    return [read(atom) for atom in jaxpr.outvars]


def _rewritten(equation: Any, values: list[Any]) -> list[Any] | None:
    """The results of `equation` rewritten, or None to bind it as it is."""
    name, params = equation.primitive.name, equation.params
    if name == CONVOLUTION and params.get("out_sharding") is None:
        return [_canonical_convolution(equation.primitive, *values, **params)]
    inner = params.get(_CALLS.get(name, ""))
    if inner is None:
        return None
    jaxpr, consts = (inner.jaxpr, inner.consts) if isinstance(inner, core.ClosedJaxpr) else (inner, ())
    if (len(jaxpr.invars) != len(values) or len(jaxpr.outvars) != len(equation.outvars)
            or not _holds_convolution(jaxpr)):
        return None
    return _evaluate(jaxpr, consts, values)


def _canonical_convolution(primitive: Any, lhs: Any, rhs: Any, *, dimension_numbers: Any, **params: Any) -> Any:
    lhs_spec, rhs_spec, out_spec = dimension_numbers
    rank = len(lhs_spec)
    spatial = tuple(range(1, rank - 1))
    canonical = jax.lax.ConvDimensionNumbers((0, rank - 1, *spatial), (rank - 1, rank - 2, *range(rank - 2)),
                                             (0, rank - 1, *spatial))
    if tuple(map(tuple, dimension_numbers)) == tuple(map(tuple, canonical)):
        return primitive.bind(lhs, rhs, dimension_numbers=dimension_numbers, **params)
    lhs = jax.numpy.transpose(lhs, (lhs_spec[0], *lhs_spec[2:], lhs_spec[1]))
    rhs = jax.numpy.transpose(rhs, (*rhs_spec[2:], rhs_spec[1], rhs_spec[0]))
    out = primitive.bind(lhs, rhs, dimension_numbers=canonical, **params)
    back = [0] * rank  # the canonical output's axis of each axis of the output asked for
    back[out_spec[0]], back[out_spec[1]] = 0, rank - 1
    for i, axis in enumerate(out_spec[2:]):
        back[axis] = 1 + i
    return jax.numpy.transpose(out, back)
