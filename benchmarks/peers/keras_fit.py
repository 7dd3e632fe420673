"""Keras 3 on JAX, `model.fit()` with TensorBoard (every 100 batches) and ModelCheckpoint
(weights every 1000 batches): a peer worker of `benchmarks/suite.py` (see `serve.py`).

Variants: `keras_fit` (one step per dispatch) and `keras_fit_spe32`
(`steps_per_execution=32`). The data is the workload's batch repeated, as NumPy arrays,
which is what `fit()` takes; a timed chunk is one epoch of `steps` batches, unshuffled.

Run by the suite with an environment that has keras, jax and tensorflow-cpu (Keras's
TensorBoard callback writes through `tf.summary`): see `make bench-peers`.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time

os.environ.setdefault("KERAS_BACKEND", "jax")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402
import workload  # noqa: E402
from serve import serve  # noqa: E402


def build(name: str, steps_per_execution: int) -> keras.Model:
    layers, _, _ = workload.arrays(name)
    activation = workload.SPECS[name]["activation"]
    model = keras.Sequential([keras.Input((layers[0][0].shape[0],))] + [
        keras.layers.Dense(w.shape[1], activation=activation if i < len(layers) - 1 else None)
        for i, (w, _) in enumerate(layers)])
    model.set_weights([a for layer in layers for a in layer])
    model.compile(optimizer=keras.optimizers.Adam(workload.LEARNING_RATE),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  steps_per_execution=steps_per_execution)
    return model


def measure(name: str):
    _, x, y = workload.arrays(name)

    def run(variant: str, steps: int, warmup: int) -> float:
        spe = {"keras_fit": 1, "keras_fit_spe32": 32}[variant]
        model = build(name, spe)
        with tempfile.TemporaryDirectory() as logdir:
            callbacks = [keras.callbacks.TensorBoard(logdir, update_freq=100),
                         keras.callbacks.ModelCheckpoint(os.path.join(logdir, "model.weights.h5"),
                                                         save_weights_only=True, save_freq=1000)]

            def fit(xs: np.ndarray, ys: np.ndarray) -> None:
                model.fit(xs, ys, batch_size=workload.BATCH, epochs=1, shuffle=False, verbose=0, callbacks=callbacks)

            fit(np.tile(x, (warmup, 1)), np.tile(y, warmup))
            xs, ys = np.tile(x, (steps, 1)), np.tile(y, steps)
            start = time.perf_counter()
            fit(xs, ys)
            elapsed = time.perf_counter() - start
        return elapsed / steps * 1e6

    return run


if __name__ == "__main__":
    serve(measure(sys.argv[1]),
          {"keras": keras.__version__, "jax": jax.__version__, "backend": keras.backend.backend()})
