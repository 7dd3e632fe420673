"""A training process fed by grain, for tests/end_to_end/test_grain.py (run as a
script; grain's worker processes import this module again, so it does nothing at import).

    python grain_worker.py LOADER CHECKPOINT_DIR LAST_STEP OUT.npz [--slow-after N]

LOADER: "dataset" (a shuffled `grain.MapDataset`, 2 worker processes through
`mp_prefetch`) or "dataloader" (a `grain.DataLoader` with a shuffling `IndexSampler`
and 2 workers). Trains a linear model with SGD (each step's update depends on that
step's batch, so the final parameters depend on the order of every batch), saving a
checkpoint every 5 steps, and writes the final parameters and the ids of the rows of
every batch it ran to OUT.npz. `--slow-after N` sleeps 0.3 s after each step past N,
so that a test can kill it there.
"""

from __future__ import annotations

import sys

import numpy as np

ROWS = 96
BATCH = 8


def rows() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {"x": rng.normal(size=(ROWS, 4)).astype(np.float32), "y": rng.normal(size=(ROWS,)).astype(np.float32),
            "id": np.arange(ROWS, dtype=np.int32)}


class Rows:
    """A random-access grain source over the rows of `rows()` (a stable repr, which a
    `grain.DataLoader` checks on resume)."""

    def __init__(self):
        self.data = rows()

    def __len__(self) -> int:
        return ROWS

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        return {key: value[index] for key, value in self.data.items()}

    def __repr__(self) -> str:
        return f"Rows({ROWS})"


def scale(row: dict[str, np.ndarray]) -> dict[str, np.ndarray]:  # work for the workers to do
    return {**row, "x": row["x"] * np.float32(0.5)}


def loader(kind: str):
    import grain

    if kind == "dataset":
        dataset = grain.MapDataset.source(Rows()).shuffle(seed=7).repeat().map(scale).batch(BATCH)
        dataset = dataset.to_iter_dataset(grain.ReadOptions(num_threads=0, prefetch_buffer_size=0))  # in memory
        return dataset.mp_prefetch(grain.MultiprocessingOptions(num_workers=2))
    sampler = grain.samplers.IndexSampler(ROWS, shuffle=True, seed=7, num_epochs=None,
                                          shard_options=grain.sharding.NoSharding())
    return grain.DataLoader(data_source=Rows(), sampler=sampler, worker_count=2,
                            operations=[grain.transforms.Batch(BATCH)])


def main(argv: list[str]) -> None:
    import time

    import jax
    import jax.numpy as jnp

    import jaxmon as jm

    kind, directory, last_step, out = argv[:4]
    slow_after = int(argv[argv.index("--slow-after") + 1]) if "--slow-after" in argv else None

    def step_fn(state, batch):
        loss, grad = jax.value_and_grad(lambda w: jnp.mean((batch["x"] @ w - batch["y"]) ** 2))(state["w"])
        return {"w": state["w"] - 0.1 * grad}, {"loss": loss, "id": batch["id"]}

    class Record(jm.Hook):
        def __init__(self):
            self.ids = []

        def before_run(self, ctx):
            return jm.RunArgs(fetches="id")

        def after_run(self, ctx, values):
            self.ids.append(values.results)
            print(f"STEP {values.step}", flush=True)
            if slow_after is not None and values.step > slow_after:
                time.sleep(0.3)

    record = Record()
    with jm.MonitoredTrainingSession(step_fn, lambda: {"w": jnp.zeros((4,), jnp.float32)}, data=loader(kind),
                                     checkpoint_dir=directory, hooks=[jm.StopAtStepHook(last_step=int(last_step)),
                                                                      record],
                                     save_checkpoint_steps=5, save_summaries_steps=None,
                                     log_step_count_steps=None) as sess:
        while not sess.should_stop():
            sess.run()
    np.savez(out, w=np.asarray(sess.state["w"]), ids=np.array(record.ids), restored=sess.restored_step or 0)
    print("DONE", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
