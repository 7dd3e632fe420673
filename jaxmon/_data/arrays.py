"""ArrayDataSource: batches from in-memory arrays, with a position a checkpoint can hold."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from jaxmon._base.errors import check_int


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
      shard: read only one part of every batch: `"process"` for this JAX process's part
        (`jax.process_index()` of `jax.process_count()`), or `(index, count)`. The rows
        are shuffled as one: a global batch is `batch_size * count` rows, and this
        source's batch is its part `index` of `count` (contiguous, as
        `make_array_from_process_local_data` expects of a batch split over processes).
        The position counts global batches, the same on every process, so a run resumed
        on another number of processes (`batch_size` set so that the global batch is the
        same) sees the same global batches. None reads every row.

    Example:
      >>> import numpy as np, jaxmon as jm
      >>> source = jm.ArrayDataSource({"x": np.arange(10)}, batch_size=4, shuffle=False)
      >>> next(source)["x"], source.get_state()
      (array([0, 1, 2, 3]), {'epoch': 0, 'index': 1, 'seed': 0})
    """

    def __init__(self, arrays: Mapping[str, Any] | np.ndarray, batch_size: int, *, shuffle: bool = True,
                 seed: int = 0, drop_remainder: bool = True, num_epochs: int | None = None,
                 shard: str | tuple[int, int] | None = None):
        if not isinstance(arrays, Mapping):
            arrays = {"x": arrays}
        arrays = {key: np.asarray(value) for key, value in arrays.items()}
        lengths = {key: len(value) for key, value in arrays.items()}
        if not lengths or len(set(lengths.values())) != 1:
            raise ValueError(f"ArrayDataSource arrays must be a non-empty dict of arrays with one first dimension; "
                             f"got lengths {lengths}.")
        self.shard = _shard(shard)
        self.arrays, self.num_rows = arrays, next(iter(lengths.values()))
        check_int("ArrayDataSource batch_size", batch_size, minimum=1)
        check_int("ArrayDataSource seed", seed)
        if num_epochs is not None:
            check_int("ArrayDataSource num_epochs", num_epochs, minimum=1)
        self.global_batch = batch_size * (self.shard or (0, 1))[1]  # rows of one batch of every shard together
        if drop_remainder and self.global_batch > self.num_rows:
            raise ValueError(f"ArrayDataSource batch_size={batch_size} takes {self.global_batch} rows a step (all "
                             f"shards together), more than the {self.num_rows} rows, so every batch would be dropped; "
                             "lower it or pass drop_remainder=False.")
        self.batch_size, self.shuffle, self.seed = batch_size, shuffle, seed
        self.drop_remainder, self.num_epochs = drop_remainder, num_epochs
        self._epoch, self._index = 0, 0
        self._order = self._permutation(0)

    def __len__(self) -> int:
        """Batches per epoch."""
        full, rest = divmod(self.num_rows, self.global_batch)
        return full + (rest >= self.global_batch // self.batch_size and not self.drop_remainder)

    def __iter__(self) -> ArrayDataSource:
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        if self._index >= len(self):
            if self.num_epochs is not None and self._epoch + 1 >= self.num_epochs:
                raise StopIteration
            self._epoch, self._index = self._epoch + 1, 0
            self._order = self._permutation(self._epoch)
        rows = self._order[self._index * self.global_batch:(self._index + 1) * self.global_batch]
        if self.shard is not None:  # this shard's part of the global batch
            index, count = self.shard
            part = len(rows) // count
            rows = rows[index * part:(index + 1) * part]
        self._index += 1
        return {key: value[rows] for key, value in self.arrays.items()}

    def get_state(self) -> dict[str, int]:
        """The position: the epoch, the batches taken in it, and the seed (with a shard,
        the rows of a global batch too): the same on every shard."""
        state = {"epoch": self._epoch, "index": self._index, "seed": self.seed}
        return state if self.shard is None else {**state, "global_batch": self.global_batch}

    def set_state(self, state: Mapping[str, int]) -> None:
        """Moves to a position from `get_state()` (of a source over the same arrays)."""
        if state.get("seed", self.seed) != self.seed:
            raise ValueError(f"ArrayDataSource.set_state: the saved position was taken with seed {state['seed']}, "
                             f"this source has seed {self.seed}; resume with the same seed.")
        saved = state.get("global_batch", self.global_batch)
        if saved != self.global_batch:
            count = (self.shard or (0, 1))[1]
            raise ValueError(f"ArrayDataSource.set_state: the saved position counts batches of {saved} rows (all "
                             f"shards together), this source's are {self.global_batch} ({self.batch_size} rows x "
                             f"{count} shards); for the same batches give batch_size={saved // count}"
                             f"{'' if saved % count == 0 else f' (it does not divide by {count})'}.")
        self._epoch, self._index = int(state["epoch"]), int(state["index"])
        self._order = self._permutation(self._epoch)

    def _permutation(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(self.num_rows)
        return np.random.default_rng([self.seed, epoch]).permutation(self.num_rows)

    def __repr__(self) -> str:
        shard = "" if self.shard is None else f", shard={self.shard}"
        return (f"ArrayDataSource({sorted(self.arrays)}, rows={self.num_rows}, batch_size={self.batch_size}, "
                f"shuffle={self.shuffle}, seed={self.seed}{shard})")


def _shard(shard: str | tuple[int, int] | None) -> tuple[int, int] | None:
    """`shard=` as `(index, count)`, or None for every row."""
    if shard is None:
        return None
    if shard == "process":
        return jax.process_index(), jax.process_count()
    if (isinstance(shard, (tuple, list)) and len(shard) == 2 and all(isinstance(i, int) for i in shard)
            and 0 <= shard[0] < shard[1]):
        return int(shard[0]), int(shard[1])
    raise ValueError(f"ArrayDataSource shard={shard!r}: give 'process' (this JAX process's part), "
                     "(index, count) with 0 <= index < count, or None (every row).")
