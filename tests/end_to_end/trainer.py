"""A small, complete training run for the subprocess tests of checkpoints.

Usage: python tests/end_to_end/trainer.py CHECKPOINT_DIR LAST_STEP SAVE_STEPS OUT.npz [STEP_DELAY_SECS]

Trains a tiny MLP (Adam, dropout from the state's RNG) on an `ArrayDataSource`,
saving every SAVE_STEPS steps, restoring from CHECKPOINT_DIR if it has checkpoints;
prints "step N" after each step, writes the final parameters to OUT.npz.
"""

from __future__ import annotations

import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxmon as jm


def init_fn():
    k1, k2 = jax.random.split(jax.random.PRNGKey(0))
    params = {"w1": jax.random.normal(k1, (4, 16)) * 0.5, "w2": jax.random.normal(k2, (16, 1)) * 0.5}
    return jm.TrainState.create(apply_fn=None, params=params, tx=optax.adam(1e-2), rng=7)


def step_fn(state, batch):
    state, key = state.next_rng()

    def loss_fn(params):
        hidden = jnp.tanh(batch["x"] @ params["w1"])
        hidden = hidden * jax.random.bernoulli(key, 0.9, hidden.shape) / 0.9
        return jnp.mean((hidden @ params["w2"] - batch["y"]) ** 2)

    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), {"loss": loss}


def data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(40, 4)).astype(np.float32)
    return jm.ArrayDataSource({"x": x, "y": np.sin(x.sum(1, keepdims=True))}, batch_size=8, seed=3)


def main(checkpoint_dir, last_step, save_steps, out, delay=0.0):
    hooks = [jm.StopAtStepHook(last_step=int(last_step)),
             jm.CheckpointSaverHook(checkpoint_dir, save_steps=int(save_steps))]
    with jm.MonitoredSession(step_fn, init_fn, data=data(), hooks=hooks, stop_grace_period_secs=30) as sess:
        print(f"start {sess.step}", flush=True)
        while not sess.should_stop():
            sess.run()
            print(f"step {sess.step}", flush=True)
            time.sleep(float(delay))
    np.savez(out, step=sess.step, **{k: np.asarray(v) for k, v in sess.state.params.items()})


if __name__ == "__main__":
    main(*sys.argv[1:])
