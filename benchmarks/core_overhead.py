"""Per-step overhead of MonitoredSession against a bare jitted loop.

Two workloads: an overhead-bound MLP (32-64-10, batch 128, Adam, data already on the
device), and a host-bound scalar step (state + x) whose device time is negligible, so
that its time per step is the host's cost of one run. Three variants run each one,
interleaved within one process in a rotating order (A B C, B C A, C A B, ...) so that
machine noise hits all alike: the bare jitted loop (jit + donation: the limit),
MonitoredSession with no hooks, and MonitoredSession with StopAtStepHook and a hook
that fetches the loss every 100 steps. Prints JSON: median us/step and ratios.

Run: .venv/bin/python benchmarks/core_overhead.py [--steps 2000] [--repeats 9]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import jax
import jax.numpy as jnp
import optax
import workload

import jaxmon as jm


def make_scalar_workload():
    def init_fn():
        return jnp.zeros((), jnp.float32)

    def step_fn(state, batch):
        state = state + batch["x"]
        return state, {"loss": state}

    return init_fn, step_fn, {"x": jnp.ones((), jnp.float32)}


def _adam_workload(params, batch, forward):
    """`init_fn`, `step_fn` (Adam on softmax cross-entropy of `forward(params, x)`) and
    the batch of a benchmark workload."""
    tx = optax.adam(workload.LEARNING_RATE)

    def init_fn():
        fresh = jax.tree.map(jnp.array, params)
        return {"params": fresh, "opt": tx.init(fresh)}

    def step_fn(state, batch):
        def loss_fn(p):
            return optax.softmax_cross_entropy_with_integer_labels(forward(p, batch["x"]), batch["y"]).mean()

        loss, grads = jax.value_and_grad(loss_fn)(state["params"])
        updates, opt = tx.update(grads, state["opt"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates), "opt": opt}, {"loss": loss}

    return init_fn, step_fn, batch


def make_mlp_workload(name: str, seed: int = 0):
    """An MLP of `workload.SPECS` (data on the device) as `init_fn`, `step_fn`, batch."""
    layers, x, y = workload.arrays(name, seed)
    activation = {"tanh": jnp.tanh, "relu": jax.nn.relu}[workload.SPECS[name]["activation"]]
    params = {f"{kind}{i}": jnp.asarray(a) for i, layer in enumerate(layers)
              for kind, a in zip("wb", layer, strict=True)}

    def forward(p, h):
        for i in range(len(layers)):
            h = h @ p[f"w{i}"] + p[f"b{i}"]
            h = activation(h) if i < len(layers) - 1 else h
        return h

    return _adam_workload(params, {"x": jnp.asarray(x), "y": jnp.asarray(y)}, forward)


def make_large_workload(seed: int = 0):
    """The compute-bound MLP: 784-512-512-10, batch 128, Adam, data on the device."""
    return make_mlp_workload("large", seed)


def make_workload(seed: int = 0):
    """The overhead-bound MLP: 32-64-10, batch 128, Adam, data on the device."""
    return make_mlp_workload("small", seed)


class EveryHundred(jm.Hook):
    def before_run(self, ctx):
        return jm.RunArgs(fetches=["loss"]) if ctx.step % 100 == 0 else None


def bare(init_fn, step_fn, batch, steps):
    step = jax.jit(step_fn, donate_argnums=0)
    state = init_fn()
    state, _ = step(state, batch)  # compile outside the timing
    jax.block_until_ready(state)
    start = time.perf_counter()
    for _ in range(steps):
        state, _ = step(state, batch)
    jax.block_until_ready(state)
    return time.perf_counter() - start


def session(hooks):
    def variant(init_fn, step_fn, batch, steps):
        sess = jm.MonitoredSession(step_fn, init_fn, hooks=hooks())
        sess.run(batch, fetches=["loss"])  # compile both variants outside the timing
        sess.run(batch)
        jax.block_until_ready(sess.state)
        start = time.perf_counter()
        for _ in range(steps):
            sess.run(batch)
        jax.block_until_ready(sess.state)
        return time.perf_counter() - start

    return variant


VARIANTS = {
    "bare_jit": bare,
    "session_no_hooks": session(lambda: []),
    "session_stop_and_fetch_every_100": session(lambda: [jm.StopAtStepHook(last_step=10**9), EveryHundred()]),
}


WORKLOADS = {
    "mlp_32_64_10_batch_128_adam": make_workload,
    "scalar_host_bound": make_scalar_workload,
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    report = {
        "steps": args.steps, "repeats": args.repeats,
        "machine": f"{platform.machine()}, {jax.devices()[0].platform}, jax {jax.__version__}",
    }
    for workload_name, make in WORKLOADS.items():
        times: dict[str, list[float]] = {name: [] for name in VARIANTS}
        names = list(VARIANTS)
        for repeat in range(args.repeats):
            for name in names[repeat % len(names):] + names[:repeat % len(names)]:  # rotate the order
                times[name].append(VARIANTS[name](*make(), args.steps) / args.steps * 1e6)
        medians = {name: statistics.median(t) for name, t in times.items()}
        report[workload_name] = {
            "median_us_per_step": {k: round(v, 1) for k, v in medians.items()},
            "ratio_to_bare": {k: round(v / medians["bare_jit"], 3) for k, v in medians.items()},
        }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
