"""Host cost per run: the main thread's CPU time that jaxmon spends around each run,
over a bare jitted loop, on a trivial step.

The step is core_overhead.py's host-bound scalar step (`state + x`, the loss is the
new state; the batch is one device array, repeated), so that the device's work is
negligible and what remains is the host's. The figure is `time.thread_time()` of the
main thread (the one calling `run()`), not wall time: work on other threads (XLA's
execution threads, Orbax's, jaxmon's background compiles) is not counted, and time
spent waiting is not counted either.

Variants, each built afresh every round, warmed up for --warmup steps outside the
timing (compiles, the first triggers, the checkpoint at creation written, other
threads idle), then timed for --steps steps; the order rotates every round (A B C D,
B C D A, ...); medians of --rounds rounds:
- bare_jit: `jax.jit(step_fn, donate_argnums=0)` called once per step on the device
  batch (the reference; one call = one step);
- session_no_hooks: `jm.MonitoredSession` with no hooks, taking its batches from
  `data=itertools.repeat(batch)`;
- mts_default_k1: `jm.MonitoredTrainingSession`'s default hooks (StepCounterHook and
  SummarySaverHook every 100 steps, writing real event files and metrics.jsonl into a
  temporary directory; CheckpointSaverHook every 600 s, TF's default, so the timed
  window holds no save: the one at creation is written before it and the one at close
  after it) + `jm.LoggingHook(["loss"], every_n_iter=100)` (formatted into a handler
  to /dev/null) + `jm.NanHook("loss")`; one step per run; no StopAtStepHook;
- mts_default_k32: the same with `steps_per_dispatch=32` (runs cut to land on the
  100-step triggers: mostly 32 steps, see `steps_per_run`).

Then `trigger_cost`: the default set, k=1, over --trigger_cycles cycles of 100 steps,
each run timed: the two runs of a trigger (the one ending on step 100n, where the step
counter, summaries, logging and the NaN read act, and the next, which delivers their
late values) and the excess of a whole cycle over 100 quiet runs, also in bare jitted
calls timed between the cycles (a unit that moves with the machine's load).

Reported per variant: main-thread CPU us per run and per step, and the excess over
bare_jit. For bare_jit, session_no_hooks and mts_default_k1 a run is one step, so the
two agree. For mts_default_k32 the comparison is per step against the bare loop of
single jitted calls: `excess_over_bare_us_per_step` is its CPU per step minus
bare_jit's, and `excess_over_bare_us_per_run` is that times its steps per run (its CPU
per run minus what the bare loop spends on as many steps). Ratios are per step.
Prints JSON.

Run: .venv/bin/python benchmarks/host_cost.py [--steps 4000] [--warmup 300] [--rounds 9]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import jax
from core_overhead import make_scalar_workload
from rotating import format_logs_into_void, rotate, session_runner, summary
from suite import make_session

import jaxmon as jm


def bare_variant(init_fn, step_fn, batch):
    """`make() -> (run, settle, close)`; `run(steps)` returns (runs, steps) done."""
    def make():
        step = jax.jit(step_fn, donate_argnums=0)
        carry = [init_fn()]

        def run(steps):
            state = carry[0]
            for _ in range(steps):
                state, _ = step(state, batch)
            carry[0] = jax.block_until_ready(state)
            return steps, steps

        return run, lambda: None, lambda: None

    return make


def session_variant(init_fn, step_fn, batch, logdir: str, training: bool, k: int = 1):
    """As `bare_variant`, for a session; a run is one `sess.run()`."""
    def make():
        sess = make_session(init_fn, step_fn, batch, logdir, training, k, stop=False)
        runner = session_runner(sess)  # its settle() and close()

        def run(steps):
            start = sess.step
            end, runs = start + steps, 0
            while sess.step < end:
                sess.run()
                runs += 1
            sess.sync()
            jax.block_until_ready(sess.state)
            return runs, sess.step - start

        return run, runner.settle, runner.close

    return make


def wait_until_other_threads_idle(timeout: float = 60.0) -> None:
    """Waits until the process's other threads (background compiles, saves) use under
    5% of a core over 50 ms, so that none of them runs beside the timed loop."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        process, thread = time.process_time(), time.thread_time()
        time.sleep(0.05)
        if (time.process_time() - process) - (time.thread_time() - thread) < 0.0025:
            return


def cpu_measure(make, warmup: int, steps_per_run: list[float]):
    """A measure for `rotate`: builds the variant, warms it up, times `steps` steps in
    main-thread CPU time; returns us per step and appends the steps per run."""
    def measure(steps: int) -> float:
        run, settle, close = make()
        run(warmup)
        settle()
        wait_until_other_threads_idle()
        start = time.thread_time()
        runs, done = run(steps)
        elapsed = time.thread_time() - start
        close()
        steps_per_run.append(done / runs)
        return elapsed / done * 1e6

    return measure


def trigger_cost(init_fn, step_fn, batch, logdir: str, cycles: int, warmup: int) -> dict[str, float]:
    """What the default set's triggers cost: main-thread CPU of every run of `cycles`
    cycles of 100 steps (the runs ending on step 100n, where the step counter, the
    summaries, the logging and the NaN read act, and the run after it, which delivers
    their late values), against the median quiet run of the same session and a bare
    jitted call timed after each run of the second half of every cycle (interleaved:
    both see the machine as it is at that moment; the unit of the `_in_bare_calls`
    figures)."""
    sess = make_session(init_fn, step_fn, batch, logdir, True, 1, stop=False)
    bare = jax.jit(step_fn, donate_argnums=0)
    state = init_fn()
    for _ in range(warmup):
        sess.run()
        state, _ = bare(state, batch)
    sess.sync()
    jax.block_until_ready((sess.state, state))
    wait_until_other_threads_idle()
    runs: dict[int, list[float]] = {}
    bare_calls: list[float] = []
    while sess.step % 100 != 2:
        sess.run()
    for _ in range(cycles):
        for _ in range(100):
            place = (sess.step + 1) % 100
            start = time.thread_time()
            sess.run()
            runs.setdefault(place, []).append(time.thread_time() - start)
            if place >= 50:  # far from the trigger's work on the report thread
                start = time.thread_time()
                state, _ = bare(state, batch)
                bare_calls.append(time.thread_time() - start)
    sess.close()
    quiet = statistics.median(t for place, times in runs.items() if place not in (0, 1) for t in times)
    cycle = [sum(runs[place][i] for place in runs) - 100 * quiet for i in range(cycles)]
    bare_us = statistics.median(bare_calls) * 1e6
    trigger = statistics.median(cycle) * 1e6
    return {"bare_call_us": round(bare_us, 2), "quiet_run_us": round(quiet * 1e6, 2),
            "run_on_step_100n_us": round(statistics.median(runs[0]) * 1e6, 1),
            "run_after_it_us": round(statistics.median(runs[1]) * 1e6, 1),
            "trigger_excess_us_per_100_steps": round(trigger, 1),
            "quiet_run_in_bare_calls": round(quiet * 1e6 / bare_us, 2),
            "run_on_step_100n_in_bare_calls": round(statistics.median(runs[0]) * 1e6 / bare_us, 1),
            "run_after_it_in_bare_calls": round(statistics.median(runs[1]) * 1e6 / bare_us, 1),
            "trigger_excess_in_bare_calls": round(trigger / bare_us, 1)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=4000, help="timed steps per variant per round")
    parser.add_argument("--warmup", type=int, default=300, help="untimed steps first")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--trigger_cycles", type=int, default=30, help="cycles of 100 steps for trigger_cost")
    args = parser.parse_args()
    format_logs_into_void()
    init_fn, step_fn, batch = make_scalar_workload()
    with tempfile.TemporaryDirectory() as logdir:
        makers = {
            "bare_jit": bare_variant(init_fn, step_fn, batch),
            "session_no_hooks": session_variant(init_fn, step_fn, batch, logdir, training=False),
            "mts_default_k1": session_variant(init_fn, step_fn, batch, logdir, training=True),
            "mts_default_k32": session_variant(init_fn, step_fn, batch, logdir, training=True, k=32),
        }
        steps_per_run: dict[str, list[float]] = {name: [] for name in makers}
        times = rotate({name: cpu_measure(make, args.warmup, steps_per_run[name]) for name, make in makers.items()},
                       args.steps, args.rounds)
    per_step = {name: statistics.median(t) for name, t in times.items()}
    per_run_of = {name: statistics.median(steps_per_run[name]) for name in times}
    excess = {name: per_step[name] - per_step["bare_jit"] for name in times}
    report = summary(times, "bare_jit", steps=args.steps, warmup=args.warmup, rounds=args.rounds,
                     clock="time.thread_time() of the main thread",
                     versions={"jaxmon": jm.__version__, "jax": jax.__version__}, jaxmon_file=jm.__file__)
    report["median_us_per_step"] = {k: round(v, 2) for k, v in per_step.items()}
    report |= {
        "steps_per_run": {k: round(v, 2) for k, v in per_run_of.items()},
        "median_us_per_run": {k: round(statistics.median(t * n for t, n in zip(times[k], steps_per_run[k],
                                                                                  strict=True)), 2)
                              for k in times},
        "excess_over_bare_us_per_step": {k: round(v, 2) for k, v in excess.items()},
        "excess_over_bare_us_per_run": {k: round(v * per_run_of[k], 2) for k, v in excess.items()},
        # The excess within each round (the variants of one round ran seconds apart), then the median.
        "median_round_excess_over_bare_us_per_step": {
            k: round(statistics.median(a - b for a, b in zip(t, times["bare_jit"], strict=True)), 2)
            for k, t in times.items()},
    }
    with tempfile.TemporaryDirectory() as logdir:
        report["trigger_cost"] = trigger_cost(init_fn, step_fn, batch, logdir, args.trigger_cycles, args.warmup)
    if args.rounds > 1:
        report["quartiles_us_per_step"] = {k: [round(q, 2) for q in statistics.quantiles(v, n=4)]
                                           for k, v in times.items()}
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
