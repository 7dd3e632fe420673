"""The comparison of the performance issue: jaxmon against the bare limits, a naive
hand-written loop, and the peers jaxmon replaces, on one workload, interleaved.

Variants (each built afresh every round, warmed up for --warmup steps, past the first
checkpoint, then timed for --steps steps;
the order rotates every round; medians of --rounds rounds):
- bare_jit: jit + donation, data on the device, no hooks (the limit, and the
  reference of the ratios);
- bare_scan32: a jitted `lax.scan` over 32 pre-stacked batches per dispatch;
- session_no_hooks: `jm.MonitoredSession` taking its batches from an iterator;
- mts_default: `jm.MonitoredTrainingSession` with its default hooks (step counter and
  summaries every 100 steps, checkpoints every 600 s as TF's default, so a timed window
  holds none: `checkpoint_save.py` reports what one save blocks) + `LoggingHook` (the
  loss every 100) + `NanHook` + `StopAtStepHook`;
- mts_default_k32: the same with `steps_per_dispatch=32`;
- naive: a hand-written loop with `float(loss)` every step, a tensorboardX scalar
  every 100 steps and a synchronous Orbax save every 600 s;
- keras_fit, keras_fit_spe32: Keras 3 on JAX, `fit()` with TensorBoard and
  ModelCheckpoint (`peers/keras_fit.py`), steps_per_execution 1 and 32;
- tf1_mts: TF 1.x `MonitoredTrainingSession` with its default hooks,
  `LoggingTensorHook` and `NanTensorHook` (`peers/tf1_session.py`).
The peers run in their own environments (`make bench-peers` creates them under
.venv-peers/, or --peers-dir); one that is missing or does not start is in `skipped`
with why, and one that fails later (an error, its worker's exit, no answer in 30
minutes) in `failed` with why, while the other variants go on. Prints JSON: medians,
ratios to bare_jit and to bare_scan32, versions, skipped and failed variants.

Run: .venv/bin/python benchmarks/suite.py [--workload small|large] [--steps 3200|1000] [--rounds 7]
     [--interleave] [--no-peers] [--peers-dir .venv-peers]
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import select
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

import jax
import orbax.checkpoint as ocp
import tensorboardX
from core_overhead import make_large_workload, make_workload
from rotating import format_logs_into_void, interleave, local, rotate, session_runner, summary
from steps_per_dispatch import variants as bare_variants

import jaxmon as jm

HERE = os.path.dirname(os.path.abspath(__file__))
PEERS = {  # variant: (environment under --peers-dir, worker script)
    "keras_fit": ("keras", "keras_fit.py"),
    "keras_fit_spe32": ("keras", "keras_fit.py"),
    "tf1_mts": ("tf", "tf1_session.py"),
}
PEER_ANSWER_SECS = 1800  # the longest a peer may take to answer one request (a round) before it counts as failed


def make_session(init_fn, step_fn, batch, logdir: str, training: bool, k: int = 1, stop: bool = True):
    """A session over `itertools.repeat(batch)`: with `training`, `MonitoredTrainingSession`'s
    default hooks (checkpoints every 600 s) + LoggingHook and NanHook (+ StopAtStepHook if `stop`)."""
    kwargs = {"data": itertools.repeat(batch), "steps_per_dispatch": k}
    if not training:
        return jm.MonitoredSession(step_fn, init_fn, **kwargs)
    hooks = [jm.StopAtStepHook(last_step=10**9)] if stop else []
    hooks += [jm.LoggingHook(["loss"], every_n_iter=100), jm.NanHook("loss")]
    return jm.MonitoredTrainingSession(step_fn, init_fn, checkpoint_dir=tempfile.mkdtemp(dir=logdir),
                                       save_checkpoint_secs=600, hooks=hooks, **kwargs)


def session_variant(init_fn, step_fn, batch, logdir: str, training: bool, k: int = 1):
    def make():
        return session_runner(make_session(init_fn, step_fn, batch, logdir, training, k))

    return make


def naive_variant(init_fn, step_fn, batch, logdir: str):
    def make():
        step = jax.jit(step_fn, donate_argnums=0)
        directory = tempfile.mkdtemp(dir=logdir)
        writer = tensorboardX.SummaryWriter(directory)
        manager = ocp.CheckpointManager(os.path.join(directory, "checkpoints"),
                                        options=ocp.CheckpointManagerOptions(enable_async_checkpointing=False))
        carry = [init_fn(), 0, -math.inf]

        def run(steps):
            state, i, saved = carry
            for _ in range(steps):
                state, outputs = step(state, batch)
                i += 1
                loss = float(outputs["loss"])
                if not math.isfinite(loss):
                    raise FloatingPointError(f"loss {loss} at step {i}")
                if i % 100 == 0:
                    writer.add_scalar("loss", loss, i)
                if time.monotonic() - saved >= 600:
                    manager.save(i, args=ocp.args.StandardSave(state))
                    saved = time.monotonic()
            carry[:] = [state, i, saved]
            return state

        def close():
            writer.close()
            manager.close()

        run.close = close
        return run

    return make


class Peer:
    """A worker process in a peer's environment (see `peers/serve.py`). Any failure (the
    worker's error, its exit, no answer within `PEER_ANSWER_SECS`) raises RuntimeError
    naming it."""

    def __init__(self, python: str, script: str, workload: str, log_path: str):
        self.log_path = log_path
        with open(log_path, "w") as log:
            self.process = subprocess.Popen([python, os.path.join(HERE, "peers", script), workload],
                                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True)
        self.versions = self._read()["versions"]

    def _read(self) -> dict:
        ready, _, _ = select.select([self.process.stdout], [], [], PEER_ANSWER_SECS)
        if not ready:
            self.process.kill()
            raise RuntimeError(f"the worker gave no answer in {PEER_ANSWER_SECS} s (stopped)")
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"the worker exited with status {self.process.wait()}: {self._last_log_line()}")
        return json.loads(line)

    def _last_log_line(self) -> str:
        with open(self.log_path) as log:
            lines = [line.strip() for line in log.read()[-4000:].splitlines() if line.strip()]
        return lines[-1] if lines else "it wrote nothing"

    def measure(self, variant: str, warmup: int) -> Callable[[int], float]:
        def run(steps: int) -> float:
            try:
                self.process.stdin.write(json.dumps({"variant": variant, "steps": steps, "warmup": warmup}) + "\n")
                self.process.stdin.flush()
            except BrokenPipeError:
                raise RuntimeError(f"the worker had exited with status {self.process.wait()}: "
                                   f"{self._last_log_line()}") from None
            answer = self._read()
            if "error" in answer:
                raise RuntimeError(answer["error"])
            return answer["us_per_step"]

        return run

    def close(self) -> None:
        try:
            self.process.stdin.close()
        except BrokenPipeError:
            pass
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()


def guarded(variant: str, measure: Callable[[int], float], failed: dict[str, str]) -> Callable[[int], float]:
    """`measure`, which once it fails records why in `failed[variant]` and is not asked again
    (NaN): one peer's failure ends its own row, not the comparison."""
    def run(steps: int) -> float:
        if variant in failed:
            return math.nan
        try:
            return measure(steps)
        except Exception as error:
            failed[variant] = f"failed while measured: {error}"
            print(f"failed {variant}: {error}; the other variants go on", file=sys.stderr)
            return math.nan

    return run


def start_peers(peers_dir: str, workload: str, warmup: int, logdir: str):
    """The peers' measures, their versions, and a message for each peer skipped."""
    measures, versions, skipped, workers = {}, {}, {}, {}
    for variant, (env, script) in PEERS.items():
        python = os.path.join(peers_dir, env, "bin", "python")
        if env not in workers:
            if not os.path.exists(python):
                workers[env] = f"no environment at {os.path.dirname(os.path.dirname(python))} (make bench-peers)"
            else:
                log_path = os.path.join(logdir, f"{env}.log")
                try:
                    workers[env] = Peer(python, script, workload, log_path)
                    versions[env] = workers[env].versions
                except Exception as error:
                    with open(log_path) as log:
                        tail = log.read()[-2000:]
                    workers[env] = f"its worker failed to start ({error}): {tail}"
        if isinstance(workers[env], str):
            skipped[variant] = workers[env]
            print(f"skipped {variant}: {workers[env]}", file=sys.stderr)
        else:
            measures[variant] = workers[env].measure(variant, warmup)
    return measures, versions, skipped, [w for w in workers.values() if isinstance(w, Peer)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workload", choices=("small", "large"), default="small")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per round (3200 small, 1000 large)")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps first (1056)")
    parser.add_argument("--peers-dir", default=os.path.join(os.path.dirname(HERE), ".venv-peers"))
    parser.add_argument("--no-peers", action="store_true", help="only this environment's variants")
    parser.add_argument("--interleave", action="store_true",
                        help="time this environment's variants side by side in alternating slices of each round")
    args = parser.parse_args()
    steps = args.steps or (3200 if args.workload == "small" else 1000)
    # Past the first triggers, so that every run length they cut is compiled before the
    # timing; the checkpoint of step 0 is written (saves then come every 600 s).
    warmup = args.warmup if args.warmup is not None else 1056
    format_logs_into_void()
    with tempfile.TemporaryDirectory() as logdir:
        init_fn, step_fn, batch = (make_workload if args.workload == "small" else make_large_workload)()
        bare = bare_variants(init_fn, step_fn, batch, logdir)
        makers = {
            "bare_jit": bare["bare_jit"],
            "bare_scan32": bare["bare_scan32"],
            "session_no_hooks": session_variant(init_fn, step_fn, batch, logdir, training=False),
            "mts_default": session_variant(init_fn, step_fn, batch, logdir, training=True),
            "mts_default_k32": session_variant(init_fn, step_fn, batch, logdir, training=True, k=32),
            "naive": naive_variant(init_fn, step_fn, batch, logdir),
        }
        measures = {name: local(maker, warmup) for name, maker in makers.items()}
        versions = {"jaxmon": jm.__version__, "jax": jax.__version__, "orbax-checkpoint": ocp.__version__}
        skipped, failed, workers = {}, {}, []
        if not args.no_peers:
            peer_measures, peer_versions, skipped, workers = start_peers(args.peers_dir, args.workload, warmup, logdir)
            measures |= {name: guarded(name, m, failed) for name, m in peer_measures.items()}
            versions |= peer_versions
        try:
            if args.interleave:  # this environment's variants side by side, in slices
                times = interleave(makers, steps, args.rounds, warmup)
                if workers:
                    times |= rotate({name: m for name, m in measures.items() if name not in makers}, steps,
                                    args.rounds)
            else:
                times = rotate(measures, steps, args.rounds)
        finally:
            for worker in workers:
                worker.close()
    times = {name: t for name, t in times.items() if name not in failed}
    result = summary(times, "bare_jit", "bare_scan32", workload=args.workload, steps=steps, rounds=args.rounds,
                     versions=versions, skipped=skipped, failed=failed)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
