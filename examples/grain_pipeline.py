"""Training from a grain pipeline: worker processes, random augmentation, exact resume.

grain (`pip install 'jaxmon[grain]'`) is the data loader of the JAX ecosystem: a
pipeline of transformations over a random-access source, run by worker processes, with
an iterator whose position can be saved. Give the session the pipeline itself
(`data=dataset`): it takes batches from it (the next ones already on their way to the
device while a step runs), saves the iterator's position with every checkpoint,
restores it on resume, and shuts the worker processes down when it ends, however it
ends (end of training, an error, SIGTERM).

This example trains a small MLP on the UCI hand-written digits. Each process reads its
own part of the rows (`process_rows`; with one process, all of them), shuffled anew
each epoch, with random pixel noise drawn by `random_map` from a seed per example (so a
resumed run draws the same noise as an uninterrupted one).

Run it twice with the same `--workdir`; the second run resumes where the first stopped:

    .venv/bin/python examples/grain_pipeline.py --steps 200 --workdir /tmp/grain_run
    .venv/bin/python examples/grain_pipeline.py --steps 400 --workdir /tmp/grain_run

Each run ends with a line such as
`step 400 (resumed from 200): test accuracy 0.9528, 2 grain workers`.
"""

from __future__ import annotations

import argparse

import flax.linen as nn
import grain
import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxmon as jm


class Rows(grain.sources.RandomAccessDataSource):
    """Random access to the rows of in-memory arrays. grain's `DataLoader` compares a
    source's repr on resume, so give yours one that names its data, not its address."""

    def __init__(self, arrays: dict[str, np.ndarray]):
        self.arrays = arrays

    def __len__(self) -> int:
        return len(self.arrays["y"])

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        return {key: value[index] for key, value in self.arrays.items()}

    def __repr__(self) -> str:
        return f"Rows(digits, {len(self)})"


def add_noise(row: dict[str, np.ndarray], rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Augmentation in the workers: pixel noise from grain's per-example generator."""
    noise = rng.normal(scale=0.05, size=row["x"].shape).astype(np.float32)
    return {"x": row["x"] + noise, "y": row["y"]}


def process_rows(dataset: grain.MapDataset) -> grain.MapDataset:
    """This JAX process's part of the rows: equal contiguous parts, one per process (the
    same split as `grain.sharding.ShardByJaxProcess` for a `grain.DataLoader`). Each
    process then feeds its batches to a sharded session, which builds the global batch
    with `jax.make_array_from_process_local_data`. Such a split resumes exactly on the
    same number of processes; `jm.ArrayDataSource(..., shard="process")` and
    `jaxmon train`'s loaders split every global batch instead, which resumes on any."""
    rows = len(dataset) // jax.process_count()
    return dataset[jax.process_index() * rows:(jax.process_index() + 1) * rows]


def pipeline(batch_size: int, workers: int, seed: int) -> grain.IterDataset:
    train = jm.datasets.digits("train")
    dataset = grain.MapDataset.source(Rows({"x": train["x"].reshape(len(train["x"]), -1), "y": train["y"]}))
    dataset = (process_rows(dataset)
               .shuffle(seed=seed)  # a new order each epoch (shuffle before repeat)
               .repeat()
               .random_map(add_noise, seed=seed)
               .batch(batch_size, drop_remainder=True))  # one shape: the step compiles once
    # The rows are in memory: no reading threads and no read-ahead buffer in a process,
    # as grain advises (its defaults, 16 threads and 500 elements, here 500 batches, are
    # for slow storage); the worker processes build the batches ahead.
    dataset = dataset.to_iter_dataset(grain.ReadOptions(num_threads=0, prefetch_buffer_size=0))
    if workers:
        dataset = dataset.mp_prefetch(grain.MultiprocessingOptions(num_workers=workers))
    return dataset


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(10)(nn.relu(nn.Dense(64)(x)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=400, help="the last step")
    parser.add_argument("--workdir", required=True, help="checkpoints; a second run here resumes")
    parser.add_argument("--workers", type=int, default=2, help="grain worker processes (0: none)")
    parser.add_argument("--batch_size", type=int, default=64)
    args = parser.parse_args()

    model, tx = MLP(), optax.adam(3e-3)

    def init_fn() -> jm.TrainState:
        params = model.init(jax.random.PRNGKey(0), jnp.zeros((1, 64)))["params"]
        return jm.TrainState.create(apply_fn=model.apply, params=params, tx=tx)

    def step_fn(state: jm.TrainState, batch):
        def loss_fn(params):
            logits = state.apply_fn({"params": params}, batch["x"])
            return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

        loss, grads = jax.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), {"loss": loss}

    with jm.MonitoredTrainingSession(step_fn, init_fn, data=pipeline(args.batch_size, args.workers, seed=0),
                                     checkpoint_dir=args.workdir, save_checkpoint_steps=100,
                                     hooks=[jm.StopAtStepHook(last_step=args.steps)]) as sess:
        while not sess.should_stop():
            sess.run()

    test = jm.datasets.digits("test")
    logits = model.apply({"params": sess.state.params}, test["x"].reshape(len(test["x"]), -1))
    accuracy = float(jnp.mean(jnp.argmax(logits, -1) == test["y"]))
    resumed = f" (resumed from {sess.restored_step})" if sess.restored_step else ""
    print(f"step {sess.step}{resumed}: test accuracy {accuracy:.4f}, {args.workers} grain workers")


if __name__ == "__main__":
    main()
