"""A first loop: a Flax linen MLP learns y = sin(3x) through a MonitoredSession.

Run: `.venv/bin/python examples/first_loop.py`. (`make train` runs the config-driven
default experiment instead: `jaxmon train --config configs/default.py`.)
"""

from __future__ import annotations

import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxmon as jm

CONFIG = {
    "steps": 2000,  # StopAtStepHook(last_step=steps)
    "batch_size": 128,
    "learning_rate": 3e-3,  # Adam
    "hidden": 64,  # width of the two tanh layers
    "log_every": 250,  # fetch and print the loss every this many steps
    "seed": 0,
}


class MLP(nn.Module):
    hidden: int

    @nn.compact
    def __call__(self, x):
        x = nn.tanh(nn.Dense(self.hidden)(x))
        x = nn.tanh(nn.Dense(self.hidden)(x))
        return nn.Dense(1)(x)


def batches(batch_size: int, seed: int):
    """Endless batches of (x, sin(3x) + noise) from a fixed seed."""
    rng = np.random.default_rng(seed)
    while True:
        x = rng.uniform(-1, 1, size=(batch_size, 1)).astype(np.float32)
        y = np.sin(3 * x) + 0.05 * rng.standard_normal(size=x.shape).astype(np.float32)
        yield {"x": x, "y": y}


def init_fn() -> jm.TrainState:
    model = MLP(CONFIG["hidden"])
    params = model.init(jax.random.PRNGKey(CONFIG["seed"]), jnp.zeros((1, 1)))["params"]
    return jm.TrainState.create(apply_fn=model.apply, params=params, tx=optax.adam(CONFIG["learning_rate"]))


def step_fn(state: jm.TrainState, batch):
    def loss_fn(params):
        prediction = state.apply_fn({"params": params}, batch["x"])
        return jnp.mean((prediction - batch["y"]) ** 2)

    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), {"loss": loss}


class PrintLoss(jm.Hook):
    """Fetches the loss every `every` steps (other steps never wait for the device)."""

    def __init__(self, every: int, last_step: int):
        self.every, self.last_step = every, last_step
        self.first = self.last = None

    def before_run(self, ctx):
        if ctx.step % self.every == 0 or ctx.step + 1 == self.last_step:
            return jm.RunArgs(fetches="loss")
        return None

    def after_run(self, ctx, values):
        if values.results is not None:
            loss = float(values.results)
            self.first = loss if self.first is None else self.first
            self.last = loss
            print(f"step {values.step:5d}  loss {loss:.5f}", flush=True)


def main() -> None:
    steps = CONFIG["steps"]
    printer = PrintLoss(every=CONFIG["log_every"], last_step=steps)
    start = time.perf_counter()
    with jm.MonitoredSession(step_fn, init_fn, data=batches(CONFIG["batch_size"], CONFIG["seed"]),
                             hooks=[jm.StopAtStepHook(last_step=steps), printer]) as sess:
        while not sess.should_stop():
            sess.run()
    seconds = time.perf_counter() - start
    print(f"trained {sess.step} steps in {seconds:.1f}s ({sess.compile_count} compilations): "
          f"loss {printer.first:.4f} -> {printer.last:.4f}")


if __name__ == "__main__":
    main()
