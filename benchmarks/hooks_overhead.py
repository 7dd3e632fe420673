"""Cost of the default hook set against a bare jitted loop.

The default set is what a monitored training run carries: StepCounterHook (every 100
steps), SummarySaverHook (every 100 steps, real TensorBoard event files and
metrics.jsonl), LoggingHook (the loss every 100 iterations, formatted and written to
a log handler), NanHook (the loss checked every step, read one step late) and
StopAtStepHook. Workload: the overhead-bound MLP of core_overhead.py (32-64-10, batch
128, Adam, data on the device). Prints JSON with median us/step and ratios to the bare
loop.

Each round builds every variant afresh, warms it up, and times --steps steps of it, in
a rotating order (A B C, B C A, ...), for --rounds rounds, so that the machine's noise
hits all alike; the medians are compared. Two reference points besides the bare loop:
the bare loop with the one host read per step that a NaN check one step late needs
(what NanHook costs at the least), and the default set without NanHook.

Run: .venv/bin/python benchmarks/hooks_overhead.py [--steps 1000] [--rounds 30]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import tempfile
import time

import jax
import numpy as np
from core_overhead import make_workload
from rotating import format_logs_into_void

import jaxmon as jm


def default_hooks(logdir: str) -> list[jm.Hook]:
    return [
        jm.StopAtStepHook(last_step=10**9),
        jm.StepCounterHook(every_n_steps=100, output_dir=logdir),
        jm.SummarySaverHook(save_steps=100, output_dir=logdir),
        jm.LoggingHook(["loss"], every_n_iter=100),
        jm.NanHook("loss"),
    ]


class Bare:
    """The limit: jit + donation, data on the device, no hooks."""

    def __init__(self, init_fn, step_fn, logdir):
        self.step = jax.jit(step_fn, donate_argnums=0)
        self.state = init_fn()

    def __call__(self, batch, steps):  # noqa: D102
        state = self.state
        for _ in range(steps):
            state, _ = self.step(state, batch)
        self.state = state
        return state


class BareReadingLossLate(Bare):
    """The bare loop plus what NanHook needs and nothing else: each step, after
    dispatching it, read the previous step's loss on the host and check it."""

    def __call__(self, batch, steps):  # noqa: D102
        state, previous = self.state, None
        for _ in range(steps):
            state, outputs = self.step(state, batch)
            if previous is not None and not math.isfinite(np.asarray(previous)):
                raise FloatingPointError("non-finite loss")
            previous = outputs["loss"]
        self.state = state
        return state


class Session:
    def __init__(self, hooks):
        self.hooks = hooks

    def __call__(self, init_fn, step_fn, logdir):
        self.sess = jm.MonitoredSession(step_fn, init_fn, hooks=self.hooks(logdir))
        return self

    def run(self, batch, steps):
        for _ in range(steps):
            self.sess.run(batch)
        self.sess.sync()
        return self.sess.state


VARIANTS = {
    "bare_jit": Bare,
    "bare_jit_reading_loss_late": BareReadingLossLate,
    "session_no_hooks": Session(lambda logdir: []),
    "session_default_hooks": Session(default_hooks),
    "session_default_hooks_without_nan": Session(lambda logdir: default_hooks(logdir)[:-1]),
}


def measure(steps: int, rounds: int) -> dict[str, list[float]]:
    """Times `steps` steps of every variant per round, in a rotating order. Each round
    builds every variant afresh (and warms it up outside the timing), so that where its
    buffers happen to land in memory is drawn anew each round rather than fixed for
    the whole run."""
    init_fn, step_fn, batch = make_workload()
    times: dict[str, list[float]] = {name: [] for name in VARIANTS}
    names = list(VARIANTS)
    with tempfile.TemporaryDirectory() as logdir:
        for r in range(rounds):
            for name in names[r % len(names):] + names[:r % len(names)]:
                runner = VARIANTS[name](init_fn, step_fn, os.path.join(logdir, f"{name}-{r}"))
                call = runner if isinstance(runner, Bare) else runner.run
                jax.block_until_ready(call(batch, 200))  # compile and first triggers outside the timing
                start = time.perf_counter()
                jax.block_until_ready(call(batch, steps))
                times[name].append((time.perf_counter() - start) / steps * 1e6)
                if not isinstance(runner, Bare):
                    runner.sess.close()
    return times


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=1000, help="steps per timed chunk")
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args()
    format_logs_into_void()
    times = measure(args.steps, args.rounds)
    medians = {name: statistics.median(t) for name, t in times.items()}
    print(json.dumps({
        "steps_per_chunk": args.steps, "rounds": args.rounds,
        "machine": f"{platform.machine()}, {os.cpu_count()} cpus, {jax.devices()[0].platform}, jax {jax.__version__}",
        "workload": "mlp_32_64_10_batch_128_adam",
        "median_us_per_step": {k: round(v, 1) for k, v in medians.items()},
        "ratio_to_bare": {k: round(v / medians["bare_jit"], 3) for k, v in medians.items()},
        "quartiles_us_per_step": {k: [round(q, 1) for q in statistics.quantiles(v, n=4)] for k, v in times.items()},
    }, indent=2))


if __name__ == "__main__":
    main()
