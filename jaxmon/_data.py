"""ArrayDataSource: batches from in-memory arrays, with a position a checkpoint can hold."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from jaxmon._errors import check_int


class ArrayDataSource:
    """Batches of in-memory NumPy arrays, reshuffled each epoch, resumable exactly.

    An iterator: each `next()` is a dict of `batch_size` rows (the same rows of every
    array). `get_state()` / `set_state()` (the protocol a `MonitoredSession` saves with
    each checkpoint) give and take its position, so a resumed run sees exactly the
    batches the interrupted one would have seen. Any iterator with these two methods
    (JSON-serialisable state) is resumed the same way.

    Args:
      arrays: a dict of arrays with equal first dimension (or a single array, given
        as {"x": array}).
      batch_size: rows per batch.
      shuffle: a new permutation each epoch, from `seed` and the epoch number.
      seed: the shuffling seed.
      drop_remainder: drop the last, smaller batch of an epoch.
      num_epochs: stop (StopIteration: the session ends cleanly) after this many
        epochs; None repeats forever.

    Example:
      >>> import numpy as np, jaxmon as jm
      >>> source = jm.ArrayDataSource({"x": np.arange(10)}, batch_size=4, shuffle=False)
      >>> next(source)["x"], source.get_state()
      (array([0, 1, 2, 3]), {'epoch': 0, 'index': 1, 'seed': 0})
    """

    def __init__(self, arrays: Mapping[str, Any] | np.ndarray, batch_size: int, *, shuffle: bool = True,
                 seed: int = 0, drop_remainder: bool = True, num_epochs: int | None = None):
        if not isinstance(arrays, Mapping):
            arrays = {"x": arrays}
        self.arrays = {key: np.asarray(value) for key, value in arrays.items()}
        lengths = {key: len(value) for key, value in self.arrays.items()}
        if not lengths or len(set(lengths.values())) != 1:
            raise ValueError(f"ArrayDataSource arrays must be a non-empty dict of arrays with one first dimension; "
                             f"got lengths {lengths}.")
        check_int("ArrayDataSource batch_size", batch_size, minimum=1)
        check_int("ArrayDataSource seed", seed)
        if num_epochs is not None:
            check_int("ArrayDataSource num_epochs", num_epochs, minimum=1)
        self.num_rows = next(iter(lengths.values()))
        if drop_remainder and batch_size > self.num_rows:
            raise ValueError(f"ArrayDataSource batch_size={batch_size} is larger than the {self.num_rows} rows, so "
                             "every batch would be dropped; lower it or pass drop_remainder=False.")
        self.batch_size, self.shuffle, self.seed = batch_size, shuffle, seed
        self.drop_remainder, self.num_epochs = drop_remainder, num_epochs
        self._epoch, self._index = 0, 0
        self._order = self._permutation(0)

    def __len__(self) -> int:
        """Batches per epoch."""
        full, rest = divmod(self.num_rows, self.batch_size)
        return full + (rest > 0 and not self.drop_remainder)

    def __iter__(self) -> ArrayDataSource:
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        if self._index >= len(self):
            if self.num_epochs is not None and self._epoch + 1 >= self.num_epochs:
                raise StopIteration
            self._epoch, self._index = self._epoch + 1, 0
            self._order = self._permutation(self._epoch)
        rows = self._order[self._index * self.batch_size:(self._index + 1) * self.batch_size]
        self._index += 1
        return {key: value[rows] for key, value in self.arrays.items()}

    def get_state(self) -> dict[str, int]:
        """The position: the epoch, the batches taken in it, and the seed."""
        return {"epoch": self._epoch, "index": self._index, "seed": self.seed}

    def set_state(self, state: Mapping[str, int]) -> None:
        """Moves to a position from `get_state()` (of a source over the same arrays)."""
        if state.get("seed", self.seed) != self.seed:
            raise ValueError(f"ArrayDataSource.set_state: the saved position was taken with seed {state['seed']}, "
                             f"this source has seed {self.seed}; resume with the same seed.")
        self._epoch, self._index = int(state["epoch"]), int(state["index"])
        self._order = self._permutation(self._epoch)

    def _permutation(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(self.num_rows)
        return np.random.default_rng([self.seed, epoch]).permutation(self.num_rows)

    def __repr__(self) -> str:
        return (f"ArrayDataSource({sorted(self.arrays)}, rows={self.num_rows}, batch_size={self.batch_size}, "
                f"shuffle={self.shuffle}, seed={self.seed})")
