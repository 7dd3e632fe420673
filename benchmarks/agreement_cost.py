"""What agreeing across JAX processes costs: 2 processes on this machine, one mesh.

Each process runs, interleaved for --rounds rounds, --steps steps of:
- bare: a jitted data-parallel step on the 2-process mesh (global batch from each
  process's half, state donated, no host sync);
- bare_allgather: the same plus one `process_allgather` of a small vector per step
  (what one agreement costs, alone);
- session: `jm.MonitoredSession(mesh=...)` with StopAtStepHook: the processes agree at
  hooks' triggers and every `agree_every_n_steps` (16) only;
- session_every_run: the same with `agree_every_n_steps=1` (an agreement after every
  run, as before agreement points);
- training: `jm.MonitoredTrainingSession` (default set: summaries and step counter every
  100 steps, checkpoints every 600 s) + NanHook, with a fresh checkpoint directory.
Every variant is built, compiled and warmed up (20 steps) outside its timed steps.
Workload: the MLP of core_overhead.py (32-64-10, batch 128 split over the processes).
Process 0 prints JSON: median us/step, ratios to bare (of the medians, and the median
of the per-round ratios).

Run: .venv/bin/python benchmarks/agreement_cost.py [--steps 300] [--rounds 7]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time


def worker(rank: int, address: str, steps: int, rounds: int, workdir: str) -> None:
    import jaxmon as jm
    from jaxmon._run import sharding as _sharding
    jm.distributed.initialize(address, num_processes=2, process_id=rank, initialization_timeout=60,
                              preemption_sync=False, log_prefix=False)
    import jax
    import numpy as np
    from core_overhead import make_workload
    from jax.experimental import multihost_utils

    init_fn, step_fn, batch = make_workload()
    mesh = jax.make_mesh((jax.device_count(),), ("data",))
    local = {k: np.asarray(v)[rank::2] for k, v in batch.items()}
    placement = _sharding.Placement(mesh)
    compiled = jax.jit(step_fn, donate_argnums=0)

    def bare(allgather=False):
        state = [placement.place_state(init_fn())]

        def run(n):
            for _ in range(n):
                state[0], _ = compiled(state[0], placement.place_batch(local))
                if allgather:
                    multihost_utils.process_allgather(np.zeros(7))
            return state[0]

        return run, lambda: None

    def session(make):
        sess = make()

        def run(n):
            for _ in range(n):
                sess.run(local)
            return sess.state

        return run, sess.close

    def plain(every):
        return session(lambda: jm.MonitoredSession(step_fn, init_fn, mesh=mesh, agree_every_n_steps=every,
                                                   hooks=[jm.StopAtStepHook(last_step=10**9)]))

    runs = itertools.count()

    def training():  # a fresh checkpoint directory each time, the same on both processes
        directory = os.path.join(workdir, str(next(runs)))
        return session(lambda: jm.MonitoredTrainingSession(step_fn, init_fn, mesh=mesh, checkpoint_dir=directory,
                                                           hooks=[jm.NanHook("loss")]))

    variants = {"bare": bare, "bare_allgather": lambda: bare(True), "session": lambda: plain(16),
                "session_every_run": lambda: plain(1), "training": training}
    times = {name: [] for name in variants}
    names = list(variants)
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            run, close = variants[name]()
            jax.block_until_ready(run(20))
            start = time.perf_counter()
            jax.block_until_ready(run(steps))
            times[name].append((time.perf_counter() - start) / steps * 1e6)
            close()
    if rank == 0:
        medians = {k: statistics.median(v) for k, v in times.items()}
        per_round = {k: statistics.median(t / b for t, b in zip(v, times["bare"], strict=True))
                     for k, v in times.items()}
        print(json.dumps({"processes": 2, "steps": steps, "rounds": rounds,
                          "median_us_per_step": {k: round(v, 1) for k, v in medians.items()},
                          "ratio_to_bare": {k: round(v / medians["bare"], 3) for k, v in medians.items()},
                          "median_ratio_per_round": {k: round(v, 3) for k, v in per_round.items()}},
                         indent=2), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--address", help=argparse.SUPPRESS)
    parser.add_argument("--workdir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        worker(args.worker, args.address, args.steps, args.rounds, args.workdir)
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{s.getsockname()[1]}"
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)
    here = os.path.dirname(os.path.abspath(__file__))
    with tempfile.TemporaryDirectory(prefix="agreement_cost_") as workdir:
        workers = [subprocess.Popen([sys.executable, os.path.join(here, "agreement_cost.py"), "--worker", str(i),
                                     "--address", address, "--steps", str(args.steps), "--rounds", str(args.rounds),
                                     "--workdir", workdir], env=env, cwd=here) for i in range(2)]
        try:
            for w in workers:
                w.wait(timeout=1800)
        finally:
            for w in workers:
                w.kill()


if __name__ == "__main__":
    main()
