"""scan_unroll: a run of several steps as a `lax.scan` loop or fully unrolled, per workload.

Workloads: `cnn`, the digits CNN of configs/default.py (`jaxmon.models.CNN`, channels
16-32, a 64 head, Adam 2e-3, batch 64, softmax cross-entropy) and `mlp`, the MLP of
core_overhead.py (32-64-10, batch 128, Adam), both with their batch on the device.
Variants, built afresh every round, timed side by side (`rotating.interleave`), medians
of --rounds rounds:
- bare_jit: one jitted step per call;
- scan{8,32}_loop / _unrolled / _canonical: a jitted `lax.scan` of 8 or 32 steps over
  stacked batches: `unroll=1`, `unroll=True`, or `unroll=1` with the step's
  convolutions rewritten (`scan_unroll.canonical_convolutions`, what "auto" does on CPU);
- session_k1, session_k{8,32}_auto: `MonitoredSession` with the default set of
  hooks_overhead.py, one step per run or `steps_per_dispatch=8`/`32` with the default
  `scan_unroll="auto"` (and a hook that ends runs where each timed slice ends).
Compile times: a bare variant's `lower().compile()`; a session's time from its creation
to every program compiled (its first run, then `compile_count`, which waits for the
programs compiled ahead).

`--cli` times the acceptance command instead: `jaxmon train --config configs/default.py
--no_compilation_cache --quiet` with `--config.session.steps_per_dispatch=8` and `=1`,
alternating, a fresh workdir each time, wall time of the whole command.

Run: .venv/bin/python benchmarks/scan_unroll.py [--workload cnn|mlp] [--steps 256] [--rounds 5]
     .venv/bin/python benchmarks/scan_unroll.py --cli [--rounds 3] [--scan_unroll True]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import optax
from core_overhead import make_workload
from flax.training.train_state import TrainState
from hooks_overhead import default_hooks
from rotating import format_logs_into_void, interleave, session_runner, summary

import jaxmon as jm
from jaxmon._run.scan_unroll import canonical_convolutions
from jaxmon.models import CNN

ROOT = pathlib.Path(__file__).resolve().parents[1]
SLICES = 8  # each round times every variant in 8 alternating slices of --steps / 8 steps


def make_cnn_workload(batch_size: int = 64):
    """The digits CNN of configs/default.py as `init_fn`, `step_fn`, batch (on the device)."""
    model, tx = CNN(channels=(16, 32), features=(64,), num_outputs=10), optax.adam(2e-3)
    train = jm.datasets.digits("train")
    batch = {"x": jnp.asarray(train["x"][:batch_size]), "y": jnp.asarray(train["y"][:batch_size])}

    def init_fn():
        params = model.init(jax.random.PRNGKey(0), batch["x"][:1])["params"]
        return TrainState.create(apply_fn=model.apply, params=params, tx=tx)

    def step_fn(state, batch):
        def loss_fn(params):
            logits = state.apply_fn({"params": params}, batch["x"])
            loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
            return loss, {"accuracy": jnp.mean(jnp.argmax(logits, -1) == batch["y"])}

        (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
        return state.apply_gradients(grads=grads), {"loss": loss, **metrics}

    return init_fn, step_fn, batch


WORKLOADS = {"cnn": make_cnn_workload, "mlp": make_workload}


class Boundaries(jm.Hook):
    """Ends runs on every multiple of `every` steps, so that a session times exactly the
    steps it is asked for (as the bare variants do), not up to a run more."""

    def __init__(self, every: int):
        self.every = every

    def next_trigger(self, step: int) -> jm.Trigger:
        return jm.Trigger(step=(step // self.every + 1) * self.every)


def variants(init_fn, step_fn, batch, logdir, compiles, every):
    """The makers of `rotating.interleave`; each records its compile time in `compiles`;
    sessions end runs on every multiple of `every` steps."""
    def compiled(name, fn, args):
        started = time.perf_counter()
        program = jax.jit(fn, donate_argnums=0).lower(*args).compile()
        compiles.setdefault(name, []).append(time.perf_counter() - started)
        return program

    def bare_jit():
        step = compiled("bare_jit", lambda state, batch: step_fn(state, batch), (init_fn(), batch))
        state = [init_fn()]

        def run(steps):
            for _ in range(steps):
                state[0], _ = step(state[0], batch)
            return state[0]
        return run

    def scan(k, unroll, canonical=False):
        name = f"scan{k}_{'unrolled' if unroll is True else 'canonical' if canonical else 'loop'}"
        stacked = jax.tree.map(lambda x: jnp.stack([x] * k), batch)
        body = canonical_convolutions(step_fn) if canonical else step_fn

        def make():
            program = compiled(name, lambda state, batches: jax.lax.scan(body, state, batches, unroll=unroll),
                               (init_fn(), stacked))
            state = [init_fn()]

            def run(steps):
                if steps % k:
                    raise ValueError(f"{name} runs multiples of {k} steps, not {steps}: give --steps and "
                                     "--warmup multiples of 8 x 32")
                for _ in range(steps // k):
                    state[0], _ = program(state[0], stacked)
                return state[0]
            return run
        return name, make

    def session(k):
        name = f"session_k{k}" + ("_auto" if k > 1 else "")

        def make():
            def data():
                while True:
                    yield batch

            started = time.perf_counter()
            hooks = [*default_hooks(tempfile.mkdtemp(dir=logdir)), Boundaries(every)]
            sess = jm.MonitoredSession(step_fn, init_fn, data=data(), hooks=hooks, steps_per_dispatch=k)
            sess.run()
            sess.compile_count  # noqa: B018 - waits for the programs compiled ahead
            compiles.setdefault(name, []).append(time.perf_counter() - started)
            return session_runner(sess)
        return name, make

    makers = {"bare_jit": bare_jit}
    for k in (8, 32):
        for unroll, canonical in ((1, False), (True, False), (1, True)):
            name, make = scan(k, unroll, canonical)
            makers[name] = make
    for k in (1, 8, 32):
        name, make = session(k)
        makers[name] = make
    return makers


def time_cli(rounds: int, steps_per_dispatch: tuple[int, ...], extra: list[str], scan_unroll: str | None) -> dict:
    """Wall seconds of the acceptance command per `steps_per_dispatch`, alternating;
    with `scan_unroll` (a Python literal), configs/default.py with `session.scan_unroll` set."""
    times: dict[int, list[float]] = {k: [] for k in steps_per_dispatch}
    config = "configs/default.py"
    with tempfile.TemporaryDirectory() as root:
        if scan_unroll is not None:
            config = f"{root}/scan_unroll.py"
            pathlib.Path(config).write_text(
                "import importlib.util\n"
                f"spec = importlib.util.spec_from_file_location('default', {str(ROOT / 'configs' / 'default.py')!r})\n"
                "default = importlib.util.module_from_spec(spec)\nspec.loader.exec_module(default)\n\n\n"
                "def get_config():\n    config = default.get_config()\n"
                f"    config['session']['scan_unroll'] = {scan_unroll}\n    return config\n")
        for r in range(rounds):
            order = steps_per_dispatch if r % 2 == 0 else tuple(reversed(steps_per_dispatch))
            for k in order:
                command = [str(ROOT / ".venv" / "bin" / "jaxmon"), "train", "--config", config,
                           "--workdir", f"{root}/x_{k}_{r}", "--no_compilation_cache", "--quiet",
                           f"--config.session.steps_per_dispatch={k}", *extra]
                started = time.perf_counter()
                subprocess.run(command, cwd=ROOT, check=True, capture_output=True)
                times[k].append(time.perf_counter() - started)
                print(f"round {r}, steps_per_dispatch={k}: {times[k][-1]:.1f} s", file=sys.stderr)
    medians = {k: statistics.median(t) for k, t in times.items()}
    first = steps_per_dispatch[-1]
    shown = "configs/default.py" if scan_unroll is None else f"configs/default.py + session.scan_unroll={scan_unroll}"
    return {"command": " ".join([f"jaxmon train --config {shown} --workdir DIR --no_compilation_cache "
                                 "--quiet --config.session.steps_per_dispatch=K", *extra]),
            "rounds": rounds, "seconds": {f"k{k}": [round(x, 1) for x in t] for k, t in times.items()},
            "median_s": {f"k{k}": round(m, 1) for k, m in medians.items()},
            f"ratio_to_k{first}": {f"k{k}": round(m / medians[first], 3) for k, m in medians.items()},
            f"median_round_ratio_to_k{first}": {  # each round's pair, run back to back: steadier under load
                f"k{k}": round(statistics.median(a / b for a, b in zip(t, times[first], strict=True)), 3)
                for k, t in times.items()}}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="cnn")
    parser.add_argument("--steps", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=64, help="steps before the timing (a multiple of 32)")
    parser.add_argument("--only", default="", help="comma-separated variants to time (default: all)")
    parser.add_argument("--cli", action="store_true", help="time the acceptance command with k=8 against k=1")
    parser.add_argument("--scan_unroll", help="--cli: set session.scan_unroll in the config (e.g. True, 1)")
    parser.add_argument("--extra", action="append", default=[], help="another argument of the command (--cli)")
    args = parser.parse_args()
    if args.cli:
        print(json.dumps(time_cli(args.rounds, (8, 1), args.extra, args.scan_unroll), indent=2))
        return
    format_logs_into_void()
    compiles: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as logdir:
        makers = variants(*WORKLOADS[args.workload](), logdir, compiles, every=args.steps // SLICES)
        if args.only:
            makers = {name: makers[name] for name in args.only.split(",")}
        times = interleave(makers, args.steps, args.rounds, warmup=args.warmup, slices=SLICES)
    result = summary(times, *["bare_jit"][:"bare_jit" in times], workload=args.workload, steps=args.steps,
                     rounds=args.rounds)
    result["median_compile_s"] = {name: round(statistics.median(t), 2) for name, t in compiles.items()}
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
