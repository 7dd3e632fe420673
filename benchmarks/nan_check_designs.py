"""What each way of checking the loss for NaN costs, in a bare jitted loop.

The workload is the MLP of core_overhead.py. Every variant is a hand-written loop (no
jaxmon), so the figures are the floor for any NanHook built that way:

- bare: jit + donation, nothing read (the limit).
- late_read: after dispatching step N, read step N-1's loss and check it (raises at
  most one step after the non-finite step: API.md's NanHook contract).
- read_if_ready: the same, but only when that loss is already computed
  (`is_ready()`); otherwise skip it. Never waits, bounds nothing.
- device_flag_every_100: a sticky `any non-finite` flag carried in the compiled step,
  read every 100 steps (raises up to 100 steps late).
- device_guard: the flag plus `where(flag, old, new)` on every state leaf, so the
  state never takes a non-finite step; read every 100 steps. With and without
  donating the state (the guard defeats XLA's in-place update of donated buffers).

Prints JSON: median us/step and the ratio to `bare`, variants rotated every round.

Run: .venv/bin/python benchmarks/nan_check_designs.py [--steps 2000] [--rounds 11]
"""

from __future__ import annotations

import argparse
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
from core_overhead import make_workload
from rotating import summary, time_rotating


def variants(init_fn, step_fn, batch):
    plain = jax.jit(step_fn, donate_argnums=0)

    def flagged(carry, batch):
        state, flag = carry
        new, outputs = step_fn(state, batch)
        return (new, flag | ~jnp.isfinite(outputs["loss"])), outputs

    def guarded(carry, batch):
        state, flag = carry
        new, outputs = step_fn(state, batch)
        bad = flag | ~jnp.isfinite(outputs["loss"])
        return (jax.tree.map(lambda n, o: jnp.where(bad, o, n), new, state), bad), outputs

    def bare(steps):
        state = init_fn()
        for _ in range(steps):
            state, _ = plain(state, batch)
        return state

    def late_read(steps):
        state, previous = init_fn(), None
        for _ in range(steps):
            state, outputs = plain(state, batch)
            if previous is not None and not math.isfinite(np.asarray(previous)):
                raise FloatingPointError("non-finite loss")
            previous = outputs["loss"]
        return state

    def read_if_ready(steps):
        state, previous = init_fn(), None
        for _ in range(steps):
            state, outputs = plain(state, batch)
            if previous is not None and previous.is_ready() and not math.isfinite(np.asarray(previous)):
                raise FloatingPointError("non-finite loss")
            previous = outputs["loss"]
        return state

    def with_flag(fn, donate):
        step = jax.jit(fn, donate_argnums=0 if donate else ())

        def run(steps):
            carry = (init_fn(), jnp.zeros((), bool))
            for i in range(steps):
                carry, _ = step(carry, batch)
                if i % 100 == 99 and bool(carry[1]):
                    raise FloatingPointError("non-finite loss")
            return carry

        return run

    return {
        "bare": bare,
        "late_read": late_read,
        "read_if_ready": read_if_ready,
        "device_flag_every_100": with_flag(flagged, True),
        "device_guard": with_flag(guarded, True),
        "device_flag_every_100_no_donation": with_flag(flagged, False),
        "device_guard_no_donation": with_flag(guarded, False),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=11)
    args = parser.parse_args()
    runs = variants(*make_workload())
    times = time_rotating({name: (lambda run=run: run) for name, run in runs.items()}, args.steps, args.rounds,
                          warmup=200)
    print(json.dumps(summary(times, "bare", steps=args.steps, rounds=args.rounds), indent=2))


if __name__ == "__main__":
    main()
