"""Several steps per dispatch: jaxmon's `steps_per_dispatch=32` against a bare
`lax.scan` over 32 steps, and both against one step per dispatch.

Workload: the MLP of core_overhead.py (32-64-10, batch 128, Adam, data on the device).
Variants, rotated every round, medians of --rounds rounds of --steps steps:
- bare_jit: one jitted step per dispatch (the reference of the other benchmarks);
- bare_scan32: a jitted `lax.scan` of 32 steps per dispatch over 32 stacked batches
  already on the device (the limit);
- session_default_k32: `MonitoredSession(steps_per_dispatch=32)` taking batches from an
  iterator, with the default set (StepCounterHook, SummarySaverHook and LoggingHook
  every 100, NanHook, StopAtStepHook): runs cut to land on steps 1, 101, 201, ...;
- session_default_k1: the same hooks, one step per run.
Prints JSON with median us/step and ratios to bare_scan32.

Run: .venv/bin/python benchmarks/steps_per_dispatch.py [--steps 3200] [--rounds 11] [--workload large]
"""

from __future__ import annotations

import argparse
import json
import tempfile

import jax
import jax.numpy as jnp
from core_overhead import make_large_workload, make_workload
from hooks_overhead import default_hooks
from rotating import format_logs_into_void, session_runner, summary, time_rotating

import jaxmon as jm


def variants(init_fn, step_fn, batch, logdir):
    single = jax.jit(step_fn, donate_argnums=0)
    scan = jax.jit(lambda state, batches: jax.lax.scan(step_fn, state, batches), donate_argnums=0)
    stacked = jax.tree.map(lambda x: jnp.stack([x] * 32), batch)

    def bare_jit(steps):
        state = init_fn()
        for _ in range(steps):
            state, _ = single(state, batch)
        return state

    def bare_scan32(steps):
        state = init_fn()
        for _ in range(steps // 32):
            state, _ = scan(state, stacked)
        return state

    def session(k):
        def make():
            def data():
                while True:
                    yield batch

            sess = jm.MonitoredSession(step_fn, init_fn, data=data(), hooks=default_hooks(tempfile.mkdtemp(dir=logdir)),
                                       steps_per_dispatch=k)

            return session_runner(sess)

        return make

    def bare(fn):
        def make():
            return fn
        return make

    return {"bare_jit": bare(bare_jit), "bare_scan32": bare(bare_scan32), "session_default_k32": session(32),
            "session_default_k1": session(1)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=3200)
    parser.add_argument("--rounds", type=int, default=11)
    parser.add_argument("--workload", choices=("small", "large"), default="small",
                        help="small: the overhead-bound MLP 32-64-10; large: the compute-bound 784-512-512-10")
    args = parser.parse_args()
    format_logs_into_void()
    with tempfile.TemporaryDirectory() as logdir:
        workload = make_workload() if args.workload == "small" else make_large_workload()
        times = time_rotating(variants(*workload, logdir), args.steps, args.rounds, warmup=min(256, args.steps))
    result = summary(times, "bare_scan32", "bare_jit", steps=args.steps, rounds=args.rounds, workload=args.workload)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
