"""What jaxmon costs a realistic step: `configs/lm.py`'s transformer, wall time per step.

The workload is built from the config as `jaxmon train` builds it (the model, the "lm"
task's step, its data), with `--override`s applied (e.g. `model.num_layers=12`,
`model.dtype=bfloat16`). Every loop trains on real data: --batches batches of the
config's text, put on the device once and taken in turn (with one batch repeated, a
session stopped on a NaN loss in its warm-up on an H200). Loops, each built once and
warmed up (each session's checks read at the end), then timed in blocks of --steps steps
in a rotating order, each block ended by its last state being ready:
- bare: `jax.jit(step_fn, donate_argnums=0)`;
- session: `jm.MonitoredSession` without hooks;
- default: `MonitoredTrainingSession`'s default set (step counter and summaries every
  100 steps, checkpoints every 600 s) + `LoggingHook(["loss"])` + `NanHook("loss")`;
- default_k8: the same with `steps_per_dispatch=8`.
Reported: each loop's median µs per step and its ratio to bare. Prints JSON.

A session that stops before its steps are done (a NaN loss, say) ends the script at
once, exit status 1: one line on stderr names the loop, the step and why, and stdout
holds `{"stopped": that line}`. A learning rate far too high
(`--override optimizer.learning_rate.peak_value=1e6`) shows it.

Run: .venv/bin/python benchmarks/transformer_overhead.py [--steps 50] [--cycles 5] [--override model.num_layers=12]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import shutil
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from typing import Any

import jax
from rotating import blocks, format_logs_into_void

import jaxmon as jm
from jaxmon._experiment.parts import parts_of

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Stopped(Exception):
    """A loop stopped before its steps were done; the message names it, the step and why."""


def workload(overrides: list[str], batches: int):
    """`configs/lm.py`'s (init_fn, step_fn, `batches` batches of its data on the device), with
    `overrides`. The init_fn is jitted once: each loop's state is made without compiling again."""
    config = jm.load_config(os.path.join(ROOT, "configs", "lm.py"), overrides)
    parts = parts_of(config)
    source = jm.ArrayDataSource(parts.data.train, parts.data.batch_size, seed=parts.seed)
    pool = [jax.device_put(batch) for batch in itertools.islice(source, batches)]
    return jax.jit(parts.init_fn), parts.task.step_fn, pool


def bare_loop(step_fn: Callable, init_fn: Callable, data: Iterator) -> Callable[[int], Any]:
    step, state = jax.jit(step_fn, donate_argnums=0), [init_fn()]

    def run(steps: int) -> Any:
        for _ in range(steps):
            state[0], _ = step(state[0], next(data))
        return state[0]

    return run


def session_loop(name: str, sess) -> Callable[[int], Any]:
    """`run(n)`: n more steps of `sess`; raises `Stopped` if the session stops or fails first."""
    def run(steps: int) -> Any:
        done = sess.step + steps
        while sess.step < done:
            if sess.should_stop():
                raise Stopped(f"{name} stopped early at step {sess.step}: {why_stopped(name, sess)}")
            try:
                sess.run()
            except Exception as error:
                raise Stopped(f"{name} failed at step {sess.step}: {one_line(error)}") from error
        return sess.state

    return run


def why_stopped(name: str, sess, timeout: float = 30.0) -> str:
    """Why a session stopped: the error its close raises (a failure held off the loop). A
    close that takes over `timeout` seconds ends the script, saying so."""
    said = f"{name} stopped early at step {sess.step}: closing it took over {timeout:.0f} s"
    watchdog = threading.Timer(timeout, give_up, args=(Stopped(said),))
    watchdog.daemon = True
    watchdog.start()
    try:
        sess.close()  # on this thread: the session's signal handlers are the main thread's
    except Exception as error:
        return one_line(error)
    finally:
        watchdog.cancel()
    return "it closed without an error (a stop was requested)"


def give_up(stop: Stopped) -> None:
    """Says why on stderr (one line) and stdout (`{"stopped": ...}`), and ends the process
    at once, whatever threads the sessions left running."""
    print(f"transformer_overhead: {stop}", file=sys.stderr, flush=True)
    print(json.dumps({"stopped": str(stop)}), flush=True)
    os._exit(1)


def settle(name: str, sess) -> None:
    """Reads every check of `sess` (`sync()`): a NaN of the warm-up stops it here, not in the timing."""
    try:
        sess.sync()
    except Exception as error:
        raise Stopped(f"{name} failed at step {sess.step}: {one_line(error)}") from error
    if sess.should_stop():
        raise Stopped(f"{name} stopped early at step {sess.step}: {why_stopped(name, sess)}")


def one_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"[:400]


def measure(args, directory: str) -> dict[str, float]:
    """The loops' median µs per step (raises `Stopped`)."""
    init_fn, step_fn, pool = workload(args.override, args.batches)

    def default(k):
        return jm.MonitoredTrainingSession(
            step_fn, init_fn, checkpoint_dir=os.path.join(directory, f"k{k}"), save_checkpoint_secs=600,
            hooks=[jm.LoggingHook(["loss"], every_n_iter=100), jm.NanHook("loss")], steps_per_dispatch=k,
            data=itertools.cycle(pool))

    sessions = {"session": jm.MonitoredSession(step_fn, init_fn, data=itertools.cycle(pool)),
                "default": default(1), "default_k8": default(8)}
    loops = {"bare": bare_loop(step_fn, init_fn, itertools.cycle(pool)),
             **{name: session_loop(name, sess) for name, sess in sessions.items()}}
    try:
        for name, loop in loops.items():
            jax.block_until_ready(loop(args.warmup))
            if name in sessions:
                settle(name, sessions[name])
    except Stopped as stop:
        raise Stopped(f"{stop} (in its warm-up of {args.warmup} steps)") from stop
    try:
        us = blocks(loops, args.cycles, args.steps, 0)
    except Stopped as stop:
        raise Stopped(f"{stop} (in the timed blocks, after a warm-up of {args.warmup} steps)") from stop
    for name, sess in sessions.items():
        try:
            sess.close()
        except Exception as error:
            raise Stopped(f"{name} failed as it closed at step {sess.step}: {one_line(error)}") from error
    return us


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=50, help="steps per timed block")
    parser.add_argument("--cycles", type=int, default=5, help="blocks per loop")
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--batches", type=int, default=64, help="distinct batches on the device, taken in turn")
    parser.add_argument("--override", action="append", default=[], help="a config key=value, e.g. model.dtype=bfloat16")
    args = parser.parse_args()
    format_logs_into_void()
    directory = tempfile.mkdtemp(prefix="transformer-overhead-")
    try:
        us = measure(args, directory)
    except Stopped as stop:
        shutil.rmtree(directory, ignore_errors=True)
        give_up(stop)
    shutil.rmtree(directory, ignore_errors=True)
    print(json.dumps({"machine": f"{platform.machine()}, {os.cpu_count()} cpus, {jax.devices()[0].device_kind}, "
                                 f"jax {jax.__version__}",
                      "overrides": args.override, "batches": args.batches,
                      "median_us_per_step": {k: round(v, 1) for k, v in us.items()},
                      "ratio_to_bare": {k: round(v / us["bare"], 3) for k, v in us.items()}}, indent=1))


if __name__ == "__main__":
    main()
