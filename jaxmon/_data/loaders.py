"""Real data loaders in a session: grain's iterators (their positions, their worker
processes), iterators without a position (`ResumableIterator`), and positions as JSON."""

from __future__ import annotations

import base64
import functools
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

logger = logging.getLogger("jaxmon")


def is_grain(data: Any) -> bool:
    """Whether `data` (an iterable or iterator) comes from grain."""
    return type(data).__module__.split(".")[0] == "grain"


def prepare_grain() -> None:
    """Lets grain's worker processes start in a program that does not parse Abseil flags:
    grain 0.2 reads a flag of its own when it starts them, which Abseil refuses before
    flags are parsed (google/grain#1355). Marks them parsed, with their defaults, if
    nothing parsed them; a program that parses them (absl.app) is left alone."""
    flags = sys.modules.get("absl.flags")
    if flags is not None and not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()


def close_iterator(iterator: Any) -> None:
    """Stops `iterator`'s background work (grain's worker processes): its `close()`, or,
    for a `grain.DataLoader`'s iterator (grain 0.2 gives it none), its dataset iterator's."""
    close = getattr(iterator, "close", None)
    if close is None and is_grain(iterator):
        close = getattr(getattr(iterator, "_iterator", None), "close", None)
    if callable(close):
        try:
            close()
        except Exception as error:  # closing must not hide why the session ended
            logger.warning("Closing the data iterator failed: %r", error)


def to_json(position: Any) -> Any:
    """A data position as checkpoint metadata holds it: bytes (a `grain.DataLoader`'s
    state) as `{"__bytes__": text}` (or `{"__base64__": ...}` when not UTF-8)."""
    if isinstance(position, (bytes, bytearray)):
        try:
            return {"__bytes__": bytes(position).decode()}
        except UnicodeDecodeError:
            return {"__base64__": base64.b64encode(position).decode()}
    return position


def from_json(position: Any) -> Any:
    """The position `to_json` wrote, as the iterator's `set_state` takes it."""
    if isinstance(position, dict) and len(position) == 1:
        if "__bytes__" in position:
            return position["__bytes__"].encode()
        if "__base64__" in position:
            return base64.b64decode(position["__base64__"])
    return position


class ResumableIterator:
    """Any iterable made resumable by counting: its position is the number of batches
    taken, and a resume replays that many from a fresh iterator (with a warning).

    For loaders without a position of their own, such as a `torch.utils.data.DataLoader`
    or a tf.data pipeline read as NumPy (`ds.as_numpy_iterator()`): the session saves
    the count with each checkpoint, and a resumed run skips the batches the interrupted
    one had consumed. The resume is exact when the loader gives the same batches in the
    same order each time it is iterated (a seeded shuffle); the replay costs the time to
    load those batches again. A loader with `get_state()` / `set_state()` (grain,
    `jm.ArrayDataSource`) resumes at once without it.

    Args:
      data: a re-iterable (each `iter(data)` starts over, as a DataLoader does) or a
        function that returns a new iterator (`lambda: ds.as_numpy_iterator()`).
      repeat: start over when the data ends (each pass is an epoch); False ends the run
        there (`StopIteration`, a clean stop).

    Example:
      >>> import jaxmon as jm
      >>> batches = jm.ResumableIterator([{"x": 1}, {"x": 2}, {"x": 3}])
      >>> next(batches), batches.get_state()
      ({'x': 1}, {'batches': 1})
    """

    def __init__(self, data: Iterable[Any] | Callable[[], Iterator[Any]], *, repeat: bool = False):
        if callable(data) and not hasattr(data, "__iter__"):
            self._start = data
        elif hasattr(data, "__iter__"):
            if iter(data) is data:
                raise TypeError(f"ResumableIterator needs data it can iterate again from the start, got the "
                                f"iterator {data!r}; pass what makes it (a DataLoader, a list) or a function "
                                "that returns a new iterator, e.g. lambda: ds.as_numpy_iterator().")
            self._start = lambda: iter(data)
        else:
            raise TypeError(f"ResumableIterator takes an iterable or a function returning an iterator, "
                            f"got {data!r}.")
        self.repeat = repeat
        self._iterator: Iterator[Any] | None = None
        self._taken = 0

    def __iter__(self) -> ResumableIterator:
        return self

    def __next__(self) -> Any:
        if self._iterator is None:
            self._iterator = iter(self._start())
        try:
            batch = next(self._iterator)
        except StopIteration:
            if not self.repeat:
                raise
            self._iterator = iter(self._start())
            batch = next(self._iterator)  # an empty pass ends the data
        self._taken += 1
        return batch

    def get_state(self) -> dict[str, int]:
        """The position: how many batches were taken."""
        return {"batches": self._taken}

    def set_state(self, state: dict[str, int]) -> None:
        """Starts over and takes (replays) `state["batches"]` batches."""
        count = int(state["batches"])
        if count == self._taken:
            return
        close_iterator(self._iterator)
        self._iterator, self._taken = None, 0
        if count:
            logger.warning("Replaying the %d batches consumed before the checkpoint, to reach its data position "
                           "(this data has no set_state(); only its count of batches was saved).", count)
        for _ in range(count):
            try:
                next(self)
            except StopIteration:
                raise ValueError(f"ResumableIterator.set_state: the data ended after {self._taken} batches, before "
                                 f"the {count} the checkpoint had consumed; resume with the same data.") from None

    def close(self) -> None:
        close_iterator(self._iterator)

    def __repr__(self) -> str:
        return f"ResumableIterator(taken={self._taken}, repeat={self.repeat})"


class _Rows:
    """The rows of in-memory arrays as grain's random-access source (a stable repr:
    a `grain.DataLoader` compares it on resume)."""

    def __init__(self, arrays: dict[str, Any]):
        self.arrays = arrays
        self._length = len(next(iter(arrays.values())))

    def __len__(self) -> int:
        return self._length

    def __getitem__(self, index: int) -> dict[str, Any]:
        return {key: value[index] for key, value in self.arrays.items()}

    def __repr__(self) -> str:
        return f"Rows({sorted(self.arrays)}, {self._length})"


def array_pipeline(arrays: dict[str, Any], batch_size: int, *, seed: int, worker_count: int,
                   shard: tuple[int, int] = (0, 1)) -> Any:
    """A grain pipeline over in-memory `arrays` (`jaxmon train` with `data.loader: "grain"`):
    the rows shuffled anew each epoch, in full batches of `batch_size` rows, built by
    `worker_count` worker processes (0: in this process). `shard=(index, count)`: part
    `index` of `count` of every batch (a process's part: the position, grain's, counts
    whole batches, so it is the same on every process and resumes on any number of them).

    The workers end with this process, however it ends (`end_with_parent`). Each batch
    is copied out of the shared memory a worker hands it over in, which is then freed
    at once: a batch kept by JAX until the interpreter's exit (on the CPU `device_put`
    may use the host memory as it is) would leave its block to Python's
    `resource_tracker`, which reports it as leaked after the run's last line."""
    try:
        import grain
    except ImportError:
        raise ImportError("data.loader 'grain' needs grain: pip install 'jaxmon[grain]'.") from None
    dataset = grain.MapDataset.source(_Rows(arrays))
    dataset = dataset.shuffle(seed=seed).repeat().batch(batch_size, drop_remainder=True)
    if shard != (0, 1):
        dataset = dataset.map(functools.partial(_part, *shard))
    # In memory: no reading threads and no read-ahead in a process, as grain advises. Its
    # defaults (16 threads, a buffer of 500 elements: here batches) made each worker build
    # 500 batches ahead, about 6.5 s of CPU per worker before a 20-step run could end.
    dataset = dataset.to_iter_dataset(grain.ReadOptions(num_threads=0, prefetch_buffer_size=0))
    if worker_count:
        dataset = dataset.mp_prefetch(grain.MultiprocessingOptions(num_workers=worker_count),
                                      worker_init_fn=functools.partial(end_with_parent, os.getpid()))
        dataset = dataset.map(_own_copy)
    return GlobalBatches(dataset, batch_size)


class GlobalBatches:
    """A pipeline of this process's parts of global batches of `global_batch` rows (the
    same pipeline on every process): its iterators' positions say so, `{"position":
    grain's, "global_batch": rows}`, which a session resumes as it is on any number of
    processes (a global position, as `jm.ArrayDataSource(shard=...)`'s)."""

    def __init__(self, dataset: Any, global_batch: int):
        self._dataset, self.global_batch = dataset, global_batch

    def __iter__(self) -> _GlobalPosition:
        prepare_grain()
        return _GlobalPosition(iter(self._dataset), self.global_batch)


class _GlobalPosition:
    def __init__(self, iterator: Any, global_batch: int):
        self._iterator, self._global_batch = iterator, global_batch

    def __iter__(self) -> _GlobalPosition:
        return self

    def __next__(self) -> Any:
        return next(self._iterator)

    def get_state(self) -> dict[str, Any]:
        return {"position": to_json(self._iterator.get_state()), "global_batch": self._global_batch}

    def set_state(self, state: dict[str, Any]) -> None:
        if state.get("global_batch") != self._global_batch:
            raise ValueError(f"The data position of the checkpoint counts batches of {state.get('global_batch')} "
                             f"rows, this run's have {self._global_batch}: give data.batch_size="
                             f"{state.get('global_batch')} to resume it.")
        self._iterator.set_state(from_json(state["position"]))

    def close(self) -> None:
        close_iterator(self._iterator)


def _part(index: int, count: int, batch: dict[str, Any]) -> dict[str, Any]:
    """Part `index` of `count` equal contiguous parts of every array of `batch`."""
    rows = len(next(iter(batch.values()))) // count
    return {key: value[index * rows:(index + 1) * rows] for key, value in batch.items()}


def _own_copy(batch: dict[str, Any]) -> dict[str, Any]:
    """`batch`'s arrays in this process's own memory (not grain's shared memory blocks)."""
    import numpy as np

    return {key: np.array(value, copy=True) for key, value in batch.items()}


#: How often a worker process checks that its parent still runs, in seconds.
_PARENT_POLL_S = 0.25


def end_with_parent(parent: int, *_: int) -> None:
    """A grain worker's init function (`mp_prefetch(worker_init_fn=...)`: grain adds the
    worker's index and count): ends this worker process when process `parent` has
    ended, however it ended, SIGKILL included.

    A daemon thread checks every 0.25 s that this process's parent is still `parent`
    (an orphan is handed to init or a subreaper), and ends the process at once
    otherwise. Linux's `PR_SET_PDEATHSIG` would not do: it fires when the *thread* that
    started the worker ends, and grain starts its workers from threads of its own.
    The shared memory the worker leaves is then freed by Python's `resource_tracker`,
    which ends too once the workers have. `array_pipeline` passes
    `functools.partial(end_with_parent, os.getpid())` to `mp_prefetch`.
    """
    if os.getppid() != parent:
        os._exit(1)

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(_PARENT_POLL_S)
        os._exit(1)

    threading.Thread(target=watch, name="jaxmon-end-with-parent", daemon=True).start()
