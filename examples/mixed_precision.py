"""Mixed precision: bfloat16 compute, float32 master weights, in a `jm.TrainState`.

The default experiment of `make train` (configs/default.py: `jm.models.CNN` on the UCI
digits, Adam 2e-3, batch 64, 1500 steps), with the usual GPU/TPU recipe:

- the state keeps params and optimizer state in float32, and so do its checkpoints;
- inside the step, params and inputs are cast to `--dtype` (bfloat16 by default) for
  the forward and backward pass: the convolutions and matmuls run in bfloat16;
- the logits are cast back to float32 before the softmax cross-entropy, so the loss
  (a log-sum-exp and a mean over the batch) is computed in float32;
- the gradient of a cast is the cast back, so gradients arrive in float32 and Adam
  updates the float32 master weights: small updates are not rounded away, as they
  would be on bfloat16 weights (8 significant bits: 1 + 1e-3 == 1).

No loss scaling is needed: bfloat16 keeps float32's 8 exponent bits (normal numbers
down to ~1e-38) and gives up mantissa bits instead, so small gradients do not
underflow to zero. float16 has 5 exponent bits (normal numbers down to ~6e-5, at most
65504): to compute in float16, scale the loss up before `jax.grad`, scale the
gradients down, and when they are not finite skip the update and lower the scale: a
dynamic loss scale, e.g. `flax.training.dynamic_scale.DynamicScale`. (On CPU, as in
the tests, bfloat16 is emulated and no faster; the gain is on GPUs and TPUs.)

Run it with (`--dtype float32` trains the same model in float32, for comparison):

    .venv/bin/python examples/mixed_precision.py --dtype bfloat16

It ends with a line such as `test accuracy 0.9833 (compute bfloat16, params float32,
1500 steps)`; checkpoints and summaries go to `--workdir` (default: a new temp dir).
"""

from __future__ import annotations

import argparse
import tempfile

import jax
import jax.numpy as jnp
import optax

import jaxmon as jm

CONFIG = {"steps": 1500, "batch_size": 64, "learning_rate": 2e-3, "seed": 0,  # as in configs/default.py
          "channels": (16, 32), "features": (64,)}
DTYPES = {"bfloat16": jnp.bfloat16, "float32": jnp.float32}


def init_fn() -> jm.TrainState:
    model = jm.models.CNN(channels=CONFIG["channels"], features=CONFIG["features"], num_outputs=10)
    params = model.init(jax.random.PRNGKey(CONFIG["seed"]), jnp.zeros((1, 8, 8, 1)))["params"]  # float32
    return jm.TrainState.create(apply_fn=model.apply, params=params, tx=optax.adam(CONFIG["learning_rate"]))


def cast(tree, dtype):
    """Every floating-point leaf of `tree` as `dtype` (integer labels stay as they are)."""
    return jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)


def logits_fn(state: jm.TrainState, params, x, compute_dtype):
    """The forward pass in `compute_dtype`; the logits come back float32."""
    logits = state.apply_fn({"params": cast(params, compute_dtype)}, cast(x, compute_dtype))
    return logits.astype(jnp.float32)


def make_step(compute_dtype):
    """A step computing in `compute_dtype` that updates the float32 params."""

    def step_fn(state: jm.TrainState, batch):
        def loss_fn(params):
            logits = logits_fn(state, params, batch["x"], compute_dtype)
            return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean(), logits

        (loss, logits), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)  # grads: float32
        accuracy = jnp.mean(jnp.argmax(logits, -1) == batch["y"])
        return state.apply_gradients(grads=grads), {"loss": loss, "accuracy": accuracy}

    return step_fn


def main(argv: list[str] | None = None) -> dict:
    """Trains in `--dtype`, prints the test accuracy; returns `{"accuracy", "step", "workdir"}`."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16", help="compute dtype")
    parser.add_argument("--steps", type=int, default=CONFIG["steps"])
    parser.add_argument("--workdir", default=None, help="checkpoints and summaries (default: a new temp dir)")
    args = parser.parse_args(argv)
    workdir = args.workdir or tempfile.mkdtemp(prefix="mixed_precision-")
    compute_dtype = DTYPES[args.dtype]
    train, test = jm.datasets.digits("train"), jm.datasets.digits("test")
    data = jm.ArrayDataSource(train, CONFIG["batch_size"], seed=CONFIG["seed"])

    @jax.jit
    def test_accuracy(state):
        logits = logits_fn(state, state.params, test["x"], compute_dtype)
        return jnp.mean(jnp.argmax(logits, -1) == test["y"])

    hooks = [jm.StopAtStepHook(last_step=args.steps)]
    with jm.MonitoredTrainingSession(make_step(compute_dtype), init_fn, data=data, checkpoint_dir=workdir,
                                     hooks=hooks) as sess:
        while not sess.should_stop():
            sess.run()
        accuracy = float(test_accuracy(sess.state))
    print(f"checkpoints and summaries in {workdir}")
    print(f"test accuracy {accuracy:.4f} (compute {args.dtype}, params float32, {sess.step} steps)")
    return {"accuracy": accuracy, "step": sess.step, "workdir": workdir}


if __name__ == "__main__":
    main()
