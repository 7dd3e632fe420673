"""What agreeing across JAX processes costs: 2 processes on this machine, one mesh.

Each process runs, interleaved for --rounds rounds, --steps steps of:
- bare: a jitted data-parallel step on the 2-process mesh (global batch from each
  process's half, state donated, no host sync);
- bare_allgather: the same plus one `process_allgather` of a 3-number vector per step
  (what jaxmon's agreement does, alone);
- session: `jm.MonitoredSession(mesh=...)` with StopAtStepHook (agreement after every run).
Workload: the MLP of core_overhead.py (32-64-10, batch 128 split over the processes).
Process 0 prints JSON: median us/step and ratios to bare.

Run: .venv/bin/python benchmarks/agreement_cost.py [--steps 300] [--rounds 7]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time


def worker(rank: int, address: str, steps: int, rounds: int) -> None:
    import jaxmon as jm

    jm.distributed.initialize(address, num_processes=2, process_id=rank, initialization_timeout=60,
                              preemption_sync=False, log_prefix=False)
    import jax
    import numpy as np
    from core_overhead import make_workload
    from jax.experimental import multihost_utils

    init_fn, step_fn, batch = make_workload()
    mesh = jax.make_mesh((jax.device_count(),), ("data",))
    local = {k: np.asarray(v)[rank::2] for k, v in batch.items()}
    placement = jm._sharding.Placement(mesh)

    def bare(n, allgather=False):
        step = jax.jit(step_fn, donate_argnums=0)
        state = placement.place_state(init_fn())
        for _ in range(n):
            state, _ = step(state, placement.place_batch(local))
            if allgather:
                multihost_utils.process_allgather(np.zeros(3))
        return state

    def session(n):
        sess = jm.MonitoredSession(step_fn, init_fn, mesh=mesh, hooks=[jm.StopAtStepHook(last_step=10**9)])
        for _ in range(n):
            sess.run(local)
        state = sess.state
        sess.close()
        return state

    variants = {"bare": bare, "bare_allgather": lambda n: bare(n, True), "session": session}
    times = {name: [] for name in variants}
    names = list(variants)
    for r in range(rounds):
        for name in names[r % 3:] + names[:r % 3]:
            jax.block_until_ready(variants[name](20))
            start = time.perf_counter()
            jax.block_until_ready(variants[name](steps))
            times[name].append((time.perf_counter() - start) / steps * 1e6)
    if rank == 0:
        medians = {k: statistics.median(v) for k, v in times.items()}
        print(json.dumps({"processes": 2, "steps": steps, "rounds": rounds,
                          "median_us_per_step": {k: round(v, 1) for k, v in medians.items()},
                          "ratio_to_bare": {k: round(v / medians["bare"], 3) for k, v in medians.items()}},
                         indent=2), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--address", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        worker(args.worker, args.address, args.steps, args.rounds)
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{s.getsockname()[1]}"
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)
    here = os.path.dirname(os.path.abspath(__file__))
    workers = [subprocess.Popen([sys.executable, os.path.join(here, "agreement_cost.py"), "--worker", str(i),
                                 "--address", address, "--steps", str(args.steps), "--rounds", str(args.rounds)],
                                env=env, cwd=here) for i in range(2)]
    try:
        for w in workers:
            w.wait(timeout=1800)
    finally:
        for w in workers:
            w.kill()


if __name__ == "__main__":
    main()
