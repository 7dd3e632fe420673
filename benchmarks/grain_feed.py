"""A session fed by a grain pipeline with worker processes, against the same session fed
batches already on the device.

Workload: the default experiment's CNN (`jaxmon.models:CNN`, channels 16-32, 64
features, Adam) on the UCI digits, batch --batch_size. Variants, alternated every
round, each a `jm.MonitoredSession` with `StopAtStepHook` only:
- on_device: --distinct batches placed on the device before timing, cycled (the limit:
  no loader, no host-to-device copy);
- grain_rows: the usual grain pipeline, `grain.MapDataset` over the rows, shuffled each
  epoch (a shuffled lookup per row), batched, with `mp_prefetch` over --workers worker
  processes; the session takes each batch ahead and sends it to the device while the
  steps before it run (`prefetch=2`, the default);
- bare_grain_rows: the same pipeline in a hand-written jitted loop that sends each
  batch to the device two steps ahead (what jaxmon adds to grain: the ratio to it);
- grain_batches: a grain source that reads whole batches (one NumPy gather per batch
  from a permutation per epoch), with the same workers: a pipeline whose CPU cost is
  small next to the step.
Each round builds its session (and grain its workers), runs --warmup steps untimed
(compilation, worker start), then times --steps steps up to the state being ready.
Prints JSON with the median us/step of each and ratios (the ratio of the medians, and the
median of the per-round ratios). On a machine whose CPU is also the device, grain's
workers take CPU time from the step itself: see benchmarks/RESULTS.md.

Run: .venv/bin/python benchmarks/grain_feed.py [--rounds 7] [--steps 600] [--workers 2]
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time

import grain
import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxmon as jm
from jaxmon._data import loaders as _loaders
from jaxmon.models import CNN


def workload(channels, features):
    train = jm.datasets.digits("train")
    model, tx = CNN(channels=channels, features=features, num_outputs=10), optax.adam(2e-3)

    def init_fn():
        params = model.init(jax.random.PRNGKey(0), jnp.asarray(train["x"][:1]))["params"]
        return jm.TrainState.create(apply_fn=model.apply, params=params, tx=tx)

    def step_fn(state, batch):
        def loss_fn(params):
            logits = state.apply_fn({"params": params}, batch["x"])
            return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

        loss, grads = jax.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), {"loss": loss}

    return train, init_fn, step_fn


class Batches(grain.sources.RandomAccessDataSource):
    """Whole batches of rows by batch index, from a permutation per epoch (one NumPy
    gather per batch instead of one shuffled lookup per row)."""

    def __init__(self, arrays, batch_size, seed=0):
        self.arrays, self.batch_size, self.seed = arrays, batch_size, seed
        self.per_epoch = len(arrays["y"]) // batch_size
        self._orders = {}  # the permutation of the epoch read last (grain reads from several threads)

    def __len__(self):
        return self.per_epoch * 10**6  # endless: epochs one after another

    def __getitem__(self, index):
        epoch, position = divmod(index, self.per_epoch)
        order = self._orders.get(epoch)
        if order is None:
            order = np.random.default_rng([self.seed, epoch]).permutation(len(self.arrays["y"]))
            self._orders = {epoch: order}
        rows = order[position * self.batch_size:(position + 1) * self.batch_size]
        return {key: value[rows] for key, value in self.arrays.items()}

    def __repr__(self):
        return f"Batches(digits, {self.batch_size}, seed={self.seed})"


def pipeline(train, batch_size, workers, per_batch=False):
    """Per row (the usual pipeline, `jaxmon train`'s with `data.loader: grain`: a shuffled
    lookup per row, then batching), or per batch."""
    if not per_batch:
        return _loaders.array_pipeline(train, batch_size, seed=0, worker_count=workers)
    dataset = grain.MapDataset.source(Batches(train, batch_size)).to_iter_dataset()
    return dataset.mp_prefetch(grain.MultiprocessingOptions(num_workers=workers)) if workers else dataset


def bare_timed(init_fn, step_fn, data, warmup, steps):
    """A hand-written loop over the same pipeline: each batch sent to the device two steps ahead."""
    step = jax.jit(step_fn, donate_argnums=0)
    state, ahead = init_fn(), [jax.device_put(next(data)) for _ in range(2)]
    for i in range(warmup + steps):
        if i == warmup:
            jax.block_until_ready(state)
            start = time.perf_counter()
        state, _ = step(state, ahead.pop(0))
        ahead.append(jax.device_put(next(data)))
    jax.block_until_ready(state)
    elapsed = time.perf_counter() - start
    _loaders.close_iterator(data)  # stops grain's workers
    return elapsed / steps * 1e6


def timed(init_fn, step_fn, data, warmup, steps):
    """us/step of `steps` steps after `warmup` untimed ones."""
    with jm.MonitoredSession(step_fn, init_fn, data=data,
                             hooks=[jm.StopAtStepHook(last_step=warmup + steps)]) as sess:
        for _ in range(warmup):
            sess.run()
        jax.block_until_ready(sess.state)
        start = time.perf_counter()
        while not sess.should_stop():
            sess.run()
        jax.block_until_ready(sess.state)
        return (time.perf_counter() - start) / steps * 1e6


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--batch_size", type=int, default=128)
    parser.add_argument("--channels", type=int, nargs="+", default=[16, 32], help="the CNN's conv channels")
    parser.add_argument("--features", type=int, nargs="+", default=[64], help="the CNN's dense features")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--distinct", type=int, default=16, help="device batches cycled by on_device")
    args = parser.parse_args()

    train, init_fn, step_fn = workload(tuple(args.channels), tuple(args.features))
    source = pipeline(train, args.batch_size, 0)
    device = [jax.device_put(batch) for batch in itertools.islice(iter(source), args.distinct)]
    names = ["on_device", "grain_rows", "bare_grain_rows", "grain_batches"]
    times = {name: [] for name in names}
    for round_ in range(args.rounds):
        for name in names[round_ % len(names):] + names[:round_ % len(names)]:
            if name == "on_device":
                data = itertools.cycle(device)
            else:
                data = pipeline(train, args.batch_size, args.workers, per_batch=name == "grain_batches")
            if name.startswith("bare"):
                _loaders.prepare_grain()
                times[name].append(bare_timed(init_fn, step_fn, iter(data), args.warmup, args.steps))
            else:
                times[name].append(timed(init_fn, step_fn, data, args.warmup, args.steps))
    medians = {name: statistics.median(values) for name, values in times.items()}

    def ratio(a, b):
        return {"ratio_of_medians": round(medians[a] / medians[b], 3), "median_of_round_ratios": round(
            statistics.median(x / y for x, y in zip(times[a], times[b], strict=True)), 3)}

    print(json.dumps({
        "workload": f"digits CNN {args.channels}-{args.features}, batch {args.batch_size}, "
                    f"{args.workers} grain workers",
        "us_per_step_median": {name: round(value, 1) for name, value in medians.items()},
        "grain_rows / on_device": ratio("grain_rows", "on_device"),
        "grain_batches / on_device": ratio("grain_batches", "on_device"),
        "grain_rows / bare_grain_rows": ratio("grain_rows", "bare_grain_rows"),
        "rounds": {name: [round(value, 1) for value in values] for name, values in times.items()},
        "backend": jax.default_backend(),
    }, indent=1))


if __name__ == "__main__":
    main()
