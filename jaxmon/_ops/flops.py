"""A step's FLOPs: XLA's count of the step, with every loop counted by its trip count.

XLA's cost analysis counts the body of a loop once, whatever its trip count: a step that
accumulates its gradients over 4 micro-batches in a `lax.scan` was counted at 0.26x of
the same step unrolled. So the step is traced to a jaxpr and XLA counts the whole; then
each `scan` in it (a `fori_loop` with static bounds is one) has its body counted alone
(its own loops counted the same way first), and the step gets `length x body - body`
more. The trip count of a `while_loop` is known only as it runs, and a scan whose body
does not lower alone (one over the collectives of a `shard_map`) has no count of its own:
each stays counted once, and the count says how many such loops the step holds. Calls (jit, custom_jvp and
custom_vjp, remat, `cond`'s branches, of which XLA counts the dearest) are looked into.

XLA counts the program before its optimisations (`Lowered.cost_analysis`); not every
platform's client gives that count (GPUs through their PJRT plugin give none): there the
step's shapes, without their shardings, are lowered for the CPU and counted instead.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
from jax.extend import core


class StepFlops(NamedTuple):
    """The FLOPs of one step, all devices together, as `step_flops` counted them.

    Attributes:
      flops: the count; None where there is none (`why` says why).
      platform: whose lowering XLA counted ("cpu" where the session's platform gives no count).
      counted_once: how many loops were counted once, not by their trip count (`while_loop`s,
        scans whose body does not lower alone).
      why: why there is no count (None with a count).
    """

    flops: float | None
    platform: str
    counted_once: int = 0
    why: str | None = None


class _NoCount(Exception):
    """XLA gave no count of a program on this platform."""


def step_flops(step_fn: Callable[..., Any], state: Any, batch: Any) -> StepFlops:
    """The FLOPs of one `step_fn(state, batch)` (both may be abstract): XLA's count with
    every loop counted by its trip count. Exceptions of the count itself (a step that
    does not trace) pass through.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> def step(w, xs):  # 4 matmuls of 8x8 by 8x8 in a scan, which XLA alone counts once
      ...     return jax.lax.scan(lambda w, x: (x @ w, None), w, xs)[0], {}
      >>> round(step_flops(step, jnp.ones((8, 8)), jnp.ones((4, 8, 8))).flops / (2 * 8 * 8 * 8))
      4
    """
    platform = jax.default_backend()
    try:
        return _count(step_fn, state, batch, platform)
    except _NoCount:
        pass
    if platform == "cpu":
        return StepFlops(None, platform, why="XLA gives no count of it on the CPU")
    try:
        cpu = jax.devices("cpu")[0]
    except RuntimeError as error:
        return StepFlops(None, platform, why=f"XLA gives no count on {platform}, and no CPU to count it on ({error})")
    with jax.default_device(cpu):
        try:
            return _count(step_fn, _plain(state), _plain(batch), "cpu")
        except _NoCount:
            return StepFlops(None, platform, why=f"XLA gives no count of it on {platform} nor lowered for the CPU")


def _count(step_fn: Callable[..., Any], state: Any, batch: Any, platform: str) -> StepFlops:
    traced = jax.jit(step_fn).trace(state, batch)
    whole = _flops(traced.lower().cost_analysis())
    loops = _Loops()
    extra = loops.extra(traced.jaxpr.jaxpr)
    return StepFlops(whole + extra, platform, loops.counted_once)


def xla_flops(closed: core.ClosedJaxpr) -> float:
    """XLA's count of `closed` lowered alone on its input shapes (loops counted once)."""
    shapes = [jax.ShapeDtypeStruct(aval.shape, aval.dtype, weak_type=getattr(aval, "weak_type", False))
              for aval in closed.in_avals]
    return _flops(jax.jit(core.jaxpr_as_fun(closed)).lower(*shapes).cost_analysis())


def _flops(cost: Any) -> float:
    """The "flops" of a cost analysis (a dict without them: none; a list of one dict per
    program in older JAX); `_NoCount` where XLA gave no analysis."""
    cost = cost[0] if isinstance(cost, list) and cost else cost
    if not isinstance(cost, dict) or cost.get("flops", 0.0) < 0:
        raise _NoCount
    return float(cost.get("flops", 0.0))


class _Loops:
    """The FLOPs XLA's count leaves out of a jaxpr's loops, and the loops it cannot count."""

    def __init__(self):
        self.counted_once = 0

    def extra(self, jaxpr: core.Jaxpr) -> float:
        """What XLA's count of `jaxpr` lacks: each scan's body counted `length - 1` times more."""
        return sum(self._extra(equation) for equation in jaxpr.eqns)

    def _extra(self, equation: core.JaxprEqn) -> float:
        name, params = equation.primitive.name, equation.params
        if name == "scan":
            try:
                once = xla_flops(params["jaxpr"])
            except _NoCount:
                raise
            except Exception:  # noqa: BLE001 - a body that does not lower alone (collectives): as XLA counts it
                self.counted_once += 1
                return self.extra(params["jaxpr"].jaxpr)
            return params["length"] * (once + self.extra(params["jaxpr"].jaxpr)) - once
        if name == "while":
            self.counted_once += 1  # its body counted once, the loops inside it by their trip counts
        if name == "cond":
            return self._cond(params["branches"])
        return sum(self.extra(inner) for inner in core.jaxprs_in_params(params))

    def _cond(self, branches: tuple[core.ClosedJaxpr, ...]) -> float:
        """XLA counts a `cond` as its dearest branch: what that lacks against the dearest one counted whole."""
        extras = [self.extra(branch.jaxpr) for branch in branches]
        if not any(extras):
            return 0.0
        counts = [xla_flops(branch) for branch in branches]
        return max(count + extra for count, extra in zip(counts, extras, strict=True)) - max(counts)


def _plain(tree: Any) -> Any:
    """`tree`'s leaves as shapes and dtypes alone (no sharding, no device)."""
    def leaf(x: Any) -> jax.ShapeDtypeStruct:
        aval = jax.typeof(x) if not isinstance(x, jax.ShapeDtypeStruct) else x
        return jax.ShapeDtypeStruct(aval.shape, aval.dtype, weak_type=getattr(aval, "weak_type", False))

    return jax.tree.map(leaf, tree)
