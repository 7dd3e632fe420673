"""A Flax NNX model (with BatchNorm and Dropout) trained in a MonitoredSession.

`jm.TrainState.from_nnx(model, tx=...)` splits the model into its graph definition,
its parameters (trained by `tx`) and the rest (`extras`: BatchNorm's running
statistics, Dropout's RNG state). Inside the step, `state.nnx_model(params)` rebuilds
a copy of the model that may mutate under `jax.grad`, and `state.nnx_extras(model)`
hands what it mutated back to `apply_gradients`. The model learns to tell apart three
interleaved spirals (synthetic, from a fixed seed), watched by built-in hooks:
`StopAtStepHook`, `LoggingHook`, `NanHook`, `SummarySaverHook` (TensorBoard events and
`metrics.jsonl` in `--workdir`) and `FinalOpsHook` (the held-out accuracy of the
final state, with the model in eval mode: running statistics, no dropout).

Run it with:

    .venv/bin/python examples/nnx_model.py --steps 400

It ends with a line such as `train loss 1.10 -> 0.15, test accuracy 0.96`.
"""

from __future__ import annotations

import argparse
import logging
import pathlib
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import jaxmon as jm

NUM_CLASSES = 3


def make_spirals(num_rows: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Three spiral arms in the plane, with a little noise."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, NUM_CLASSES, size=num_rows)
    radius = rng.uniform(0.1, 1.0, size=num_rows)
    angle = 2 * np.pi * labels / NUM_CLASSES + 6.0 * radius + rng.normal(scale=0.2, size=num_rows)
    points = np.stack([radius * np.cos(angle), radius * np.sin(angle)], axis=1)
    return points.astype(np.float32), labels.astype(np.int32)


class MLP(nnx.Module):
    def __init__(self, hidden: int, *, rngs: nnx.Rngs):
        self.linear1 = nnx.Linear(2, hidden, rngs=rngs)
        self.norm1 = nnx.BatchNorm(hidden, rngs=rngs)
        self.dropout = nnx.Dropout(0.1, rngs=rngs)
        self.linear2 = nnx.Linear(hidden, hidden, rngs=rngs)
        self.norm2 = nnx.BatchNorm(hidden, rngs=rngs)
        self.out = nnx.Linear(hidden, NUM_CLASSES, rngs=rngs)

    def __call__(self, x):
        x = self.dropout(nnx.relu(self.norm1(self.linear1(x))))
        x = nnx.relu(self.norm2(self.linear2(x)))
        return self.out(x)


def step_fn(state: jm.TrainState, batch):
    def loss_fn(params):
        model = state.nnx_model(params)  # a copy in train mode: batch statistics, dropout
        logits = model(batch["x"])
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
        return loss, (state.nnx_extras(model), logits)

    (loss, (extras, logits)), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
    accuracy = jnp.mean(jnp.argmax(logits, -1) == batch["y"])
    return state.apply_gradients(grads=grads, extras=extras), {"loss": loss, "accuracy": accuracy}


def test_accuracy_fn(test_x: np.ndarray, test_y: np.ndarray):
    """A fetch `fn(state, batch, outputs)`: accuracy on held-out data, in eval mode."""
    def test_accuracy(state, batch, outputs):
        model = state.nnx_model()
        model.eval()  # BatchNorm uses its running statistics; Dropout does nothing
        return jnp.mean(jnp.argmax(model(test_x), -1) == test_y)

    return test_accuracy


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=400, help="training steps")
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--workdir", default=None, help="summaries go here (default: a new temp dir)")
    args = parser.parse_args(argv)
    workdir = pathlib.Path(args.workdir or tempfile.mkdtemp(prefix="nnx_model-"))
    logging.getLogger("jaxmon").setLevel(logging.INFO)  # show LoggingHook's lines

    train_x, train_y = make_spirals(4096, seed=1)
    test_x, test_y = make_spirals(1024, seed=2)

    def init_fn() -> jm.TrainState:
        return jm.TrainState.from_nnx(MLP(args.hidden, rngs=nnx.Rngs(0)), tx=optax.adam(1e-2))

    final = jm.FinalOpsHook({"test_accuracy": test_accuracy_fn(test_x, test_y)})
    hooks = [
        jm.StopAtStepHook(last_step=args.steps),
        jm.LoggingHook(["loss", "accuracy"], every_n_iter=max(args.steps // 4, 1)),
        jm.NanHook("loss"),
        jm.SummarySaverHook(save_steps=10, output_dir=workdir),
        final,
    ]
    data = jm.ArrayDataSource({"x": train_x, "y": train_y}, batch_size=args.batch_size, seed=0)
    losses = []
    with jm.MonitoredSession(step_fn, init_fn, data=data, hooks=hooks) as sess:
        while not sess.should_stop():
            losses.append(sess.run()["loss"])  # device arrays: read once, at the end
    losses = np.asarray(jax.device_get(losses))
    window = max(min(10, len(losses) // 4), 1)
    first, last = losses[:window].mean(), losses[-window:].mean()
    print(f"trained {sess.step} steps; summaries in {workdir}")
    print(f"train loss {first:.4f} -> {last:.4f} (mean of the first and last {window} steps), "
          f"test accuracy {float(final.final_values['test_accuracy']):.4f}")


if __name__ == "__main__":
    main()
