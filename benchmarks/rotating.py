"""The timing harness the benchmarks share: variants rotated every round, medians."""

from __future__ import annotations

import os
import platform
import statistics
import time
from collections.abc import Callable
from typing import Any

import jax


def time_rotating(makers: dict[str, Callable[[], Callable[[int], Any]]], steps: int, rounds: int,
                  warmup: int) -> dict[str, list[float]]:
    """Microseconds per step of each variant, one figure per round.

    Each round makes every variant afresh (`maker()` returns `run(steps) -> pytree`,
    optionally with a `close()`), runs `warmup` steps outside the timing (compiles,
    first triggers), then times `steps` steps; the order rotates (A B C, B C A, ...) so
    that the machine's noise hits all alike."""
    times: dict[str, list[float]] = {name: [] for name in makers}
    names = list(makers)
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            run = makers[name]()
            jax.block_until_ready(run(warmup))
            start = time.perf_counter()
            jax.block_until_ready(run(steps))
            times[name].append((time.perf_counter() - start) / steps * 1e6)
            getattr(run, "close", lambda: None)()
    return times


def summary(times: dict[str, list[float]], reference: str, **fields: Any) -> dict[str, Any]:
    """Medians and ratios to `reference`, with the machine, as the scripts print them."""
    medians = {name: statistics.median(t) for name, t in times.items()}
    return {
        **fields,
        "machine": f"{platform.machine()}, {os.cpu_count()} cpus, {jax.devices()[0].platform}, jax {jax.__version__}",
        "median_us_per_step": {k: round(v, 1) for k, v in medians.items()},
        f"ratio_to_{reference}": {k: round(v / medians[reference], 3) for k, v in medians.items()},
    }
