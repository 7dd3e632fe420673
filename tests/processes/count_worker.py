"""One of the JAX processes of a run that a test resumes on another number of processes,
for tests/processes/test_process_counts.py (run as a script, one process alone or under
`jaxmon launch -n N`).

    python count_worker.py LOADER CHECKPOINT_DIR LAST_STEP OUT

LOADER: "arrays" (`jm.ArrayDataSource(shard="process")`) or "grain" (`jaxmon train`'s grain
pipeline, each process's part of every batch). Global batches of `GLOBAL_BATCH` rows of
`ROWS` (an epoch is 5 batches), split over the processes; each process's part goes onto
a mesh of every process's devices. Trains to LAST_STEP (a checkpoint every 3 steps) and
writes `OUT.<process index>.json`: the step it resumed from and the row ids of each batch
it took, in order (batches taken ahead of the last step included).
"""

from __future__ import annotations

import json
import os
import sys

ROWS = 40
GLOBAL_BATCH = 8
SEED = 7


class Recorded:
    """`data`'s batches, their row ids recorded as they are taken; its position as its own."""

    def __init__(self, data):
        self.data, self.ids = iter(data), []

    def __iter__(self):
        return self

    def __next__(self):
        batch = next(self.data)
        self.ids.append([int(i) for i in batch["id"]])
        return batch

    def get_state(self):
        return self.data.get_state()

    def set_state(self, state):
        self.data.set_state(state)


def main(loader: str, directory: str, last_step: int, out: str) -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np

    import jaxmon as jm
    from jaxmon._data.loaders import array_pipeline

    if os.environ.get("JAX_NUM_PROCESSES"):
        jm.distributed.initialize()
    index, count = jax.process_index(), jax.process_count()
    rng = np.random.default_rng(0)
    rows = {"x": rng.normal(size=(ROWS, 4)).astype(np.float32), "id": np.arange(ROWS, dtype=np.int32)}
    if loader == "arrays":
        source = jm.ArrayDataSource(rows, GLOBAL_BATCH // count, seed=SEED, shard="process")
    else:
        source = iter(array_pipeline(rows, GLOBAL_BATCH, seed=SEED, worker_count=0, shard=(index, count)))
    data = Recorded(source)

    def step_fn(state, batch):  # the state depends on every batch's rows, in order
        state = state * 0.5 + jnp.sum(batch["x"])
        return state, {"loss": state}

    mesh = jax.make_mesh((jax.device_count(),), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    with jm.MonitoredTrainingSession(step_fn, lambda: jnp.zeros(()), data=data, mesh=mesh, checkpoint_dir=directory,
                                     save_checkpoint_steps=3, save_summaries_steps=None, log_step_count_steps=None,
                                     hooks=[jm.StopAtStepHook(last_step=last_step)]) as sess:
        restored = sess.step
        while not sess.should_stop():
            sess.run()
    with open(f"{out}.{index}.json", "w") as f:
        json.dump({"restored": restored, "count": count, "ids": data.ids}, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4])
