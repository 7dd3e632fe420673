"""Where step_pair.py's default set spends its time over a bare loop: the same device-bound
MLP and the same set (`MonitoredTrainingSession`'s default hooks + `LoggingHook` +
`NanHook`, one step per run), taken apart, in one process:
- `program`: the session's compiled step (with its accumulators' carry) called alone in a
  loop: what jaxmon adds inside the step;
- `quiet`: the set with every trigger pushed past the run (summaries, step counter,
  goodput and the logged loss every 10^6 steps): the step plus the host's work per run;
- `default_set`: the set as step_pair.py runs it (triggers every 100 steps).
The loops run in blocks of --steps steps, the order rotating every cycle; reported as
median µs per step and the ratio to the bare loop.

Run: .venv/bin/python benchmarks/step_parts.py [--cycles 20] [--steps 500]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import tempfile


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cycles", type=int, default=20, help="blocks of --steps steps per loop")
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--warmup", type=int, default=300)
    args = parser.parse_args()

    import jax.numpy as jnp
    from core_overhead import make_workload
    from rotating import bare_runner, blocks, format_logs_into_void

    import jaxmon as jm

    format_logs_into_void()
    init_fn, step_fn, batch = make_workload()
    directory = tempfile.mkdtemp()

    def session(name: str, every: int):
        hooks = [jm.LoggingHook(["loss"], every_n_iter=every), jm.NanHook("loss")]
        return jm.MonitoredTrainingSession(step_fn, init_fn, checkpoint_dir=os.path.join(directory, name),
                                           save_checkpoint_secs=600, hooks=hooks, data=itertools.repeat(batch),
                                           save_summaries_steps=every, log_step_count_steps=every)

    sessions = {"quiet": session("quiet", 10**6), "default_set": session("default_set", 100)}

    def run_session(sess):
        def run(n):
            for _ in range(n):
                sess.run()
            return sess.state
        return run

    for sess in sessions.values():
        sess.run()  # the step compiled: its program, to call alone
    program = sessions["quiet"]._dispatch._compiled  # noqa: SLF001 - the step as the session compiled it
    variant = program._variants[(), 1]  # noqa: SLF001
    alone = [init_fn(), jnp.copy(sessions["quiet"]._accumulators.carry)]  # noqa: SLF001

    def run_program(n):
        for _ in range(n):
            alone[0], _, _, alone[1] = variant(alone[0], batch, alone[1])
        return alone[0]

    loops = {"bare": bare_runner(step_fn, init_fn, batch), **{k: run_session(s) for k, s in sessions.items()},
             "program": run_program}
    us = blocks(loops, args.cycles, args.steps, args.warmup)
    for sess in sessions.values():
        sess.close()
    print(json.dumps({"median_us_per_step": {k: round(v, 2) for k, v in us.items()},
                      "ratio_to_bare": {k: round(v / us["bare"], 3) for k, v in us.items()}}, indent=1))


if __name__ == "__main__":
    main()
