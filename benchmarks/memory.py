"""Memory of the jaxmon loop against the bare loop: peak RSS and live device arrays.

Workload: the `wide` MLP of workload.py (1024-4096-4096-10, batch 8, Adam): a 252 MB
state (parameters and both Adam moments), so that one accidental copy of it shows.
Each variant runs --steps steps in a fresh process (peak RSS is per process), all of
which import jaxmon, so that only the loop differs; processes are rotated over
--rounds rounds, and the medians are compared. Per process:
- baseline_mb: peak RSS after the imports, before the state exists;
- peak_mb: peak RSS at the end of the loop (before close);
- loop_mb = peak_mb - baseline_mb: what the state, the compiled step and the loop cost;
- end_mb: the current RSS at the end of the loop (what stays held after any save);
- live_mb: the bytes of every live JAX array at the end of the loop (device memory;
  `memory_stats()` is None on the CPU backend).
Variants: bare_jit (jit + donation: the limit), bare_jit_saving (the same, with a plain
asynchronous Orbax save of the initial state as the loop starts: what a save costs), session_no_hooks, session_default
(the default hook set of hooks_overhead.py, no checkpoints), mts_default
(MonitoredTrainingSession with the default hooks + LoggingHook + NanHook + checkpoints
every 1000 steps: it saves step 0 when it starts, so its peak includes one host copy
of the state being written), mts_default_k32 (the same, steps_per_dispatch=32), and
naive (the hand-written loop of suite.py, which saves synchronously at step 1000,
outside this run).

Run: .venv/bin/python benchmarks/memory.py [--steps 64] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile

VARIANTS = ("bare_jit", "bare_jit_saving", "session_no_hooks", "session_default", "mts_default", "mts_default_k32",
            "naive")


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _peak_mb() -> float:
    """This process's peak RSS since it started this program: /proc's VmHWM, which exec
    resets (getrusage's ru_maxrss keeps a bigger parent's peak from before the exec)."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1024  # kB
    except (OSError, StopIteration):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def child(variant: str, steps: int) -> dict:
    import itertools
    import logging

    import jax
    import orbax.checkpoint as ocp
    from core_overhead import make_mlp_workload
    from hooks_overhead import default_hooks
    from rotating import session_runner
    from suite import naive_variant, session_variant

    import jaxmon as jm

    logging.getLogger("jaxmon").setLevel(logging.WARNING)
    baseline = _peak_mb()
    init_fn, step_fn, batch = make_mlp_workload("wide")
    with tempfile.TemporaryDirectory() as logdir:
        if variant.startswith("bare_jit"):
            step = jax.jit(step_fn, donate_argnums=0)

            def make():
                def run(n):
                    state = init_fn()
                    checkpointer = ocp.StandardCheckpointer()  # asynchronous; made in both, so only the save differs
                    if variant == "bare_jit_saving":  # what a save of the state costs while training goes on
                        checkpointer.save(os.path.join(logdir, "0"), state)
                    for _ in range(n):
                        state, _ = step(state, batch)
                    checkpointer.wait_until_finished()
                    return state
                return run
        elif variant == "session_default":
            def make():
                return session_runner(jm.MonitoredSession(step_fn, init_fn, data=itertools.repeat(batch),
                                                          hooks=default_hooks(logdir)))
        elif variant == "naive":
            make = naive_variant(init_fn, step_fn, batch, logdir)
        else:
            make = session_variant(init_fn, step_fn, batch, logdir, training=variant.startswith("mts"),
                                   k=32 if variant.endswith("k32") else 1)
        run = make()
        state = jax.block_until_ready(run(steps))
        measured = {"baseline_mb": baseline, "peak_mb": _peak_mb(), "end_mb": _rss_mb(),
                    "live_mb": sum(a.nbytes for a in jax.live_arrays()) / 2**20,
                    "state_mb": sum(a.nbytes for a in jax.tree.leaves(state)) / 2**20}
        getattr(run, "close", lambda: None)()
    measured["loop_mb"] = measured["peak_mb"] - measured["baseline_mb"]
    return measured


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--child", choices=VARIANTS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.steps)))
        return
    figures: dict[str, list[dict]] = {name: [] for name in VARIANTS}
    for r in range(args.rounds):
        for name in VARIANTS[r % len(VARIANTS):] + VARIANTS[:r % len(VARIANTS)]:
            done = subprocess.run([sys.executable, __file__, "--child", name, "--steps", str(args.steps)],
                                  capture_output=True, text=True, check=False, cwd=os.path.dirname(__file__))
            if done.returncode:
                sys.exit(f"{name} failed:\n{done.stderr[-3000:]}")
            figures[name].append(json.loads(done.stdout.strip().splitlines()[-1]))
    medians = {name: {key: round(statistics.median(f[key] for f in runs), 1) for key in runs[0]}
               for name, runs in figures.items()}
    bare = medians["bare_jit"]
    import jax
    print(json.dumps({
        "workload": "wide MLP 1024-4096-4096-10, batch 8, Adam", "steps": args.steps, "rounds": args.rounds,
        "machine": f"{os.cpu_count()} cpus, {jax.devices()[0].platform}, jax {jax.__version__}",
        "median_mb": medians,
        "ratio_to_bare": {name: {key: round(m[key] / bare[key], 3) for key in ("peak_mb", "loop_mb", "end_mb",
                                                                                "live_mb")}
                          for name, m in medians.items()},
    }, indent=2))


if __name__ == "__main__":
    main()
