"""The benchmark workloads, in NumPy alone, so that the peers' environments (Keras, TF
1.x), which have no jaxmon, build the same model on the same data.

An MLP trained with Adam (learning rate 1e-3) on softmax cross-entropy, batch 128, one
fixed batch from a fixed seed:
- small: 32-64-10, tanh (overhead-bound: ~75 us per step on 2 CPU cores);
- large: 784-512-512-10, relu (compute-bound: ~3.7 ms per step);
- wide: 1024-4096-4096-10, relu, batch 8 (a 252 MB state for `memory.py`).
"""

from __future__ import annotations

import numpy as np

SPECS = {
    "small": {"sizes": (32, 64, 10), "activation": "tanh", "init_scale": 0.1},
    "large": {"sizes": (784, 512, 512, 10), "activation": "relu", "init_scale": 0.05},
    "wide": {"sizes": (1024, 4096, 4096, 10), "activation": "relu", "init_scale": 0.02, "batch": 8},
}
BATCH = 128
LEARNING_RATE = 1e-3


def arrays(name: str, seed: int = 0) -> tuple[list[tuple[np.ndarray, np.ndarray]], np.ndarray, np.ndarray]:
    """`(layers, x, y)`: the initial `(weight, bias)` of every layer, a batch of inputs
    (float32) and labels (int32); batch 128 unless the spec says otherwise."""
    spec = SPECS[name]
    rng = np.random.default_rng(seed)
    sizes = spec["sizes"]
    layers = [((rng.standard_normal((m, n)) * spec["init_scale"]).astype(np.float32), np.zeros(n, np.float32))
              for m, n in zip(sizes[:-1], sizes[1:], strict=True)]
    batch = spec.get("batch", BATCH)
    x = rng.standard_normal((batch, sizes[0])).astype(np.float32)
    y = rng.integers(0, sizes[-1], batch).astype(np.int32)
    return layers, x, y
