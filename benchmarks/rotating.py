"""The timing harness the benchmarks share: variants rotated every round, medians."""

from __future__ import annotations

import logging
import os
import platform
import statistics
import time
from collections.abc import Callable
from typing import Any

import jax

import jaxmon as jm


def local(maker: Callable[[], Callable[[int], Any]], warmup: int) -> Callable[[int], float]:
    """A measurement of a variant run in this process: `maker()` returns `run(steps) ->
    pytree` (optionally with a `close()`, and a `settle()` that waits for background
    work the warmup started, such as the checkpoint of step 0); `warmup` steps run
    outside the timing (compiles, first triggers), then `steps` are timed. Returns
    microseconds per step."""
    def measure(steps: int) -> float:
        run = maker()
        jax.block_until_ready(run(warmup))
        getattr(run, "settle", lambda: None)()
        start = time.perf_counter()
        jax.block_until_ready(run(steps))
        elapsed = time.perf_counter() - start
        getattr(run, "close", lambda: None)()
        return elapsed / steps * 1e6

    return measure


def bare_runner(step_fn: Callable[..., Any], init_fn: Callable[[], Any], batch: Any) -> Callable[[int], Any]:
    """`run(steps)`: `steps` more steps of a bare `jax.jit(step_fn, donate_argnums=0)` loop
    on `batch`, from `init_fn()`; returns the state."""
    step, state = jax.jit(step_fn, donate_argnums=0), [init_fn()]

    def run(steps: int) -> Any:
        for _ in range(steps):
            state[0], _ = step(state[0], batch)
        return state[0]

    return run


def session_runner(sess) -> Callable[[int], Any]:
    """`run(steps)` for `local`: `steps` more steps of a jaxmon session (whatever its runs'
    lengths), its late hooks delivered; `close()` closes the session."""
    def run(steps: int) -> Any:
        end = sess.step + steps
        while sess.step < end:
            sess.run()
        sess.sync()
        return sess.state

    def settle() -> None:
        for hook in sess.hooks:
            if isinstance(hook, jm.CheckpointSaverHook):
                hook.wait_until_finished()

    run.close, run.settle = sess.close, settle
    return run


def blocks(loops: dict[str, Callable[[int], Any]], cycles: int, steps: int, warmup: int) -> dict[str, float]:
    """Median microseconds per step of each loop, in this process: `warmup` steps of each
    first, then `cycles` blocks of `steps` steps of each, the order rotating every cycle,
    each block timed up to its last state being ready. `loops[name](n)` runs `n` more
    steps and returns the state."""
    for loop in loops.values():
        jax.block_until_ready(loop(warmup))
    names, times = list(loops), {name: [] for name in loops}
    for cycle in range(cycles):
        for name in names[cycle % len(names):] + names[:cycle % len(names)]:
            start = time.perf_counter()
            jax.block_until_ready(loops[name](steps))
            times[name].append((time.perf_counter() - start) / steps)
    return {name: statistics.median(values) * 1e6 for name, values in times.items()}


def rotate(measures: dict[str, Callable[[int], float]], steps: int, rounds: int) -> dict[str, list[float]]:
    """Microseconds per step of each variant, one figure per round. `measures[name](steps)`
    builds the variant afresh, times `steps` steps and returns microseconds per step; the
    order rotates (A B C, B C A, ...) so that the machine's noise hits all alike."""
    times: dict[str, list[float]] = {name: [] for name in measures}
    names = list(measures)
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            times[name].append(measures[name](steps))
    return times


def interleave(makers: dict[str, Callable[[], Callable[[int], Any]]], steps: int, rounds: int, warmup: int,
               slices: int = 8) -> dict[str, list[float]]:
    """Microseconds per step of each variant, one figure per round, with the variants
    side by side: each round builds every variant, warms each up (see `local`), then
    times `steps` steps of each in `slices` alternating slices (the order rotating every
    slice), so that a slow second of the machine falls on all of them alike."""
    times: dict[str, list[float]] = {name: [] for name in makers}
    names = list(makers)
    per_slice = max(1, steps // slices)
    for _ in range(rounds):
        runs = {}
        for name in names:
            runs[name] = makers[name]()
            jax.block_until_ready(runs[name](warmup))
            getattr(runs[name], "settle", lambda: None)()
        spent = dict.fromkeys(names, 0.0)
        for i in range(slices):
            for name in names[i % len(names):] + names[:i % len(names)]:
                start = time.perf_counter()
                jax.block_until_ready(runs[name](per_slice))
                spent[name] += time.perf_counter() - start
        for name in names:
            getattr(runs[name], "close", lambda: None)()
            times[name].append(spent[name] / (per_slice * slices) * 1e6)
    return times


def time_rotating(makers: dict[str, Callable[[], Callable[[int], Any]]], steps: int, rounds: int,
                  warmup: int) -> dict[str, list[float]]:
    """`rotate` over variants run in this process (see `local`)."""
    return rotate({name: local(maker, warmup) for name, maker in makers.items()}, steps, rounds)


def summary(times: dict[str, list[float]], *references: str, **fields: Any) -> dict[str, Any]:
    """Medians and ratios to each of `references`, with the machine, as the scripts
    print them."""
    medians = {name: statistics.median(t) for name, t in times.items()}
    return {
        **fields,
        "machine": f"{platform.machine()}, {os.cpu_count()} cpus, {jax.devices()[0].platform}, jax {jax.__version__}",
        "median_us_per_step": {k: round(v, 1) for k, v in medians.items()},
        **{f"ratio_to_{reference}": {k: round(v / medians[reference], 3) for k, v in medians.items()}
           for reference in references},
        # The ratio within each round (the variants of one round ran minutes apart at most), then the median.
        **{f"median_round_ratio_to_{reference}": {
            k: round(statistics.median(a / b for a, b in zip(t, times[reference], strict=True)), 3)
            for k, t in times.items()} for reference in references},
    }


def format_logs_into_void() -> None:
    """Has jaxmon format every INFO line, as a real run would, into /dev/null."""
    log = logging.getLogger("jaxmon")
    log.addHandler(logging.StreamHandler(open(os.devnull, "w")))  # noqa: SIM115
    log.setLevel(logging.INFO)
    log.propagate = False
