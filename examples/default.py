"""The default example: a Flax linen MLP learns y = sin(3x) through a MonitoredSession.

Run with `make train` (or `.venv/bin/python examples/default.py`).
"""

from __future__ import annotations

import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxmon as jm

STEPS = 2000
BATCH = 128


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.tanh(nn.Dense(64)(x))
        x = nn.tanh(nn.Dense(64)(x))
        return nn.Dense(1)(x)


def batches(seed: int = 0):
    """Endless batches of (x, sin(3x) + noise) from a fixed seed."""
    rng = np.random.default_rng(seed)
    while True:
        x = rng.uniform(-1, 1, size=(BATCH, 1)).astype(np.float32)
        y = np.sin(3 * x) + 0.05 * rng.standard_normal(size=x.shape).astype(np.float32)
        yield {"x": x, "y": y}


def init_fn() -> jm.TrainState:
    model = MLP()
    params = model.init(jax.random.PRNGKey(0), jnp.zeros((1, 1)))["params"]
    return jm.TrainState.create(apply_fn=model.apply, params=params, tx=optax.adam(3e-3))


def step_fn(state: jm.TrainState, batch):
    def loss_fn(params):
        prediction = state.apply_fn({"params": params}, batch["x"])
        return jnp.mean((prediction - batch["y"]) ** 2)

    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), {"loss": loss}


class PrintLoss(jm.Hook):
    """Fetches the loss every `every` steps (other steps never wait for the device)."""

    def __init__(self, every: int):
        self.every = every
        self.first = self.last = None

    def before_run(self, ctx):
        if ctx.step % self.every == 0 or ctx.step + 1 == STEPS:
            return jm.RunArgs(fetches=["loss"])
        return None

    def after_run(self, ctx, values):
        if values.results is not None:
            loss = float(values.results["loss"])
            self.first = loss if self.first is None else self.first
            self.last = loss
            print(f"step {values.step:5d}  loss {loss:.5f}", flush=True)


def main() -> None:
    printer = PrintLoss(every=250)
    start = time.perf_counter()
    with jm.MonitoredSession(step_fn, init_fn, data=batches(),
                             hooks=[jm.StopAtStepHook(last_step=STEPS), printer]) as sess:
        while not sess.should_stop():
            sess.run()
    seconds = time.perf_counter() - start
    print(f"trained {sess.step} steps in {seconds:.1f}s ({sess.compile_count} compilations): "
          f"loss {printer.first:.4f} -> {printer.last:.4f}")


if __name__ == "__main__":
    main()
