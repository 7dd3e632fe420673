"""What jaxmon costs a realistic step: `configs/lm.py`'s transformer, wall time per step.

The workload is built from the config as `jaxmon train` builds it (the model, the "lm"
task's step, its data), with `--override`s applied (e.g. `model.num_layers=12`,
`model.dtype=bfloat16`). Loops, each built once and warmed up, then timed in blocks of
--steps steps in a rotating order, each block ended by its last state being ready:
- bare: `jax.jit(step_fn, donate_argnums=0)` on one batch already on the device;
- session: `jm.MonitoredSession` without hooks, on the same batch;
- default: `MonitoredTrainingSession`'s default set (step counter and summaries every
  100 steps, checkpoints every 600 s) + `LoggingHook(["loss"])` + `NanHook("loss")`;
- default_k8: the same with `steps_per_dispatch=8`.
Reported: each loop's median µs per step and its ratio to bare. Prints JSON.

Run: .venv/bin/python benchmarks/transformer_overhead.py [--steps 50] [--cycles 5] [--override model.num_layers=12]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import tempfile

import jax
from rotating import bare_runner, blocks, format_logs_into_void

import jaxmon as jm
from jaxmon._experiment.parts import parts_of

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def workload(overrides: list[str]):
    """`configs/lm.py`'s (init_fn, step_fn, one batch on the device), with `overrides`."""
    config = jm.load_config(os.path.join(ROOT, "configs", "lm.py"), overrides)
    parts = parts_of(config)
    batch = next(iter(jm.ArrayDataSource(parts.data.train, parts.data.batch_size)))
    return parts.init_fn, parts.task.step_fn, jax.device_put(batch)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=50, help="steps per timed block")
    parser.add_argument("--cycles", type=int, default=5, help="blocks per loop")
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--override", action="append", default=[], help="a config key=value, e.g. model.dtype=bfloat16")
    args = parser.parse_args()
    format_logs_into_void()
    init_fn, step_fn, batch = workload(args.override)
    bare = bare_runner(step_fn, init_fn, batch)

    with tempfile.TemporaryDirectory() as directory:
        def default(k):
            return jm.MonitoredTrainingSession(
                step_fn, init_fn, checkpoint_dir=os.path.join(directory, f"k{k}"), save_checkpoint_secs=600,
                hooks=[jm.LoggingHook(["loss"], every_n_iter=100), jm.NanHook("loss")], steps_per_dispatch=k,
                data=itertools.repeat(batch))

        sessions = {"session": jm.MonitoredSession(step_fn, init_fn, data=itertools.repeat(batch)),
                    "default": default(1), "default_k8": default(8)}

        def run(sess, n):
            done = sess.step + n
            while sess.step < done:
                sess.run()
            return sess.state

        loops = {"bare": bare, **{name: (lambda n, sess=sess: run(sess, n)) for name, sess in sessions.items()}}
        us = blocks(loops, args.cycles, args.steps, args.warmup)
        for sess in sessions.values():
            sess.close()
    print(json.dumps({"machine": f"{platform.machine()}, {os.cpu_count()} cpus, {jax.devices()[0].device_kind}, "
                                 f"jax {jax.__version__}",
                      "overrides": args.override, "median_us_per_step": {k: round(v, 1) for k, v in us.items()},
                      "ratio_to_bare": {k: round(v / us["bare"], 3) for k, v in us.items()}}, indent=1))


if __name__ == "__main__":
    main()
