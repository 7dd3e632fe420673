"""The step's own work: wall time per step of the default set on a device-bound step,
against a bare jitted loop, for this checkout and another commit, paired in one process.

Workload: core_overhead.py's MLP (32-64-10, batch 128, Adam, data on the device), whose
step is the device's work (on the CPU, the same cores). Three loops in one process: a
bare `jax.jit(step_fn, donate_argnums=0)` loop, and `MonitoredTrainingSession`'s
default set (step counter and summaries every 100 steps, checkpoints every 600 s) +
`LoggingHook(["loss"], every_n_iter=100)` + `NanHook("loss")`, one step per run, built
with this checkout's `jaxmon` and with the other commit's (loaded beside it as
`jaxmon_base`, as trigger_pair.py does). They run in blocks of --steps steps, the order
rotating every cycle, each block timed in wall time up to its last state being ready.
Each round is a new process; reported per round and as the median of the rounds:
- each loop's median µs per step;
- `this_over_bare` and `base_over_bare`: the default set's time per step over the bare
  loop's (what everything jaxmon adds costs, inside the step and around it);
- `this_over_base`: this checkout's default set over the other commit's.

Run: .venv/bin/python benchmarks/step_pair.py --base baa03a3 [--rounds 5] [--cycles 20] [--steps 500]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile

from trigger_pair import default_sets, run_rounds


def one_round(base_dir: str, cycles: int, steps: int, warmup: int) -> dict[str, float]:
    """One process: the three loops, `cycles` blocks of `steps` steps each, rotating."""
    from core_overhead import make_workload
    from rotating import bare_runner, blocks

    init_fn, step_fn, batch = workload = make_workload()
    with tempfile.TemporaryDirectory() as directory:
        sessions = default_sets(base_dir, workload, directory)

        def run_session(name, n):
            sess = sessions[name]
            for _ in range(n):
                sess.run()
            return sess.state

        us = blocks({"bare": bare_runner(step_fn, init_fn, batch), "base": lambda n: run_session("base", n),
                     "this": lambda n: run_session("this", n)}, cycles, steps, warmup)
        for sess in sessions.values():
            sess.close()
    return {**{f"{name}_us": round(value, 2) for name, value in us.items()},
            "this_over_bare": round(us["this"] / us["bare"], 3), "base_over_bare": round(us["base"] / us["bare"], 3),
            "this_over_base": round(us["this"] / us["base"], 3)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--base", required=True, help="the commit to compare with")
    parser.add_argument("--rounds", type=int, default=5, help="processes, one after the other")
    parser.add_argument("--cycles", type=int, default=20, help="blocks of --steps steps per loop per round")
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--warmup", type=int, default=300)
    parser.add_argument("--round", help=argparse.SUPPRESS)  # a round's process: the unpacked base
    args = parser.parse_args()
    if args.round:
        print(json.dumps(one_round(args.round, args.cycles, args.steps, args.warmup)))
        return
    rounds = run_rounds(os.path.abspath(__file__), args.base, args.rounds, "--cycles", str(args.cycles),
                        "--steps", str(args.steps), "--warmup", str(args.warmup))
    print(json.dumps({"base": args.base, "clock": "wall time per step, blocks ended by block_until_ready",
                      "rounds": rounds, "median": {key: round(statistics.median(r[key] for r in rounds), 3)
                                                   for key in rounds[0]}}, indent=1))


if __name__ == "__main__":
    main()
