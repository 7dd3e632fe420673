"""MultiWriter, the default writer of a directory, and SummaryWriterCache (one shared writer per directory)."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence

from jaxmon._writers.background import BackgroundWriter
from jaxmon._writers.interface import SummaryWriter, restart
from jaxmon._writers.jsonl import JsonlWriter
from jaxmon._writers.tensorboard import TensorBoardWriter


class MultiWriter:
    """Writes everything to each of several writers (e.g. TensorBoard and JSON lines)."""

    def __init__(self, writers: Sequence[SummaryWriter]):
        self.writers = tuple(writers)

    def write_scalars(self, step, scalars):
        for writer in self.writers:
            writer.write_scalars(step, scalars)

    def write_histograms(self, step, arrays):
        for writer in self.writers:
            writer.write_histograms(step, arrays)

    def write_images(self, step, images):
        for writer in self.writers:
            writer.write_images(step, images)

    def write_texts(self, step, texts):
        for writer in self.writers:
            writer.write_texts(step, texts)

    def write_hparams(self, hparams):
        for writer in self.writers:
            writer.write_hparams(hparams)

    def restart(self, step):
        for writer in self.writers:
            restart(writer, step)

    def flush(self):
        for writer in self.writers:
            writer.flush()

    def close(self):
        for writer in self.writers:
            writer.close()

    def __repr__(self) -> str:
        return f"MultiWriter({list(self.writers)!r})"


def default_writer(logdir: str | os.PathLike, more: Sequence[SummaryWriter] = ()) -> MultiWriter:
    """TensorBoard event files in `logdir` plus `logdir/metrics.jsonl` (and `more` writers)."""
    return MultiWriter([TensorBoardWriter(logdir), JsonlWriter(os.path.join(logdir, "metrics.jsonl")), *more])


class SummaryWriterCache:
    """One shared writer per directory, so that hooks writing to one `logdir` share one
    event file (TF's `SummaryWriterCache`).

    `get(logdir)` returns a handle on the directory's `default_writer`, which writes on
    the report thread (`BackgroundWriter`: the loop only queues; `flush()` waits for
    the writes); closing the handle releases it, and the writer closes when its last
    handle does.

    Example:
      >>> import tempfile
      >>> logdir = tempfile.mkdtemp()
      >>> a, b = SummaryWriterCache.get(logdir), SummaryWriterCache.get(logdir)
      >>> a.writer is b.writer
      True
      >>> a.close(); b.close()
    """

    _lock = threading.Lock()
    _writers: dict[str, list] = {}  # logdir -> [writer, number of open handles]
    _more: dict[str, list[SummaryWriter]] = {}  # logdir -> writers its next shared writer writes to too

    @classmethod
    def add_writer(cls, logdir: str | os.PathLike, writer: SummaryWriter) -> None:
        """Makes the shared writer of `logdir`, when it opens next, write to `writer` too
        (an experiment tracker's, `MlflowWriter`), and close it with itself."""
        key = os.path.abspath(os.fspath(logdir))
        with cls._lock:
            if key in cls._writers:
                raise RuntimeError(f"The summaries of {key} are being written already: add {writer!r} before a "
                                   "hook or session opens the directory's writer.")
            cls._more.setdefault(key, []).append(writer)

    @classmethod
    def get(cls, logdir: str | os.PathLike) -> _SharedWriter:
        key = os.path.abspath(os.fspath(logdir))
        with cls._lock:
            entry = cls._writers.get(key)
            if entry is None:
                entry = cls._writers[key] = [BackgroundWriter(default_writer(key, cls._more.pop(key, ()))), 0]
            entry[1] += 1
        return _SharedWriter(key, entry[0], cls._release)

    @classmethod
    def _release(cls, key: str) -> None:
        with cls._lock:
            entry = cls._writers[key]
            entry[1] -= 1
            if entry[1] > 0:
                return
            del cls._writers[key]
        entry[0].close()

    @classmethod
    def flush(cls) -> None:
        """Flushes every cached writer."""
        with cls._lock:
            writers = [writer for writer, _ in cls._writers.values()]
        for writer in writers:
            writer.flush()

    @classmethod
    def clear(cls) -> None:
        """Closes every cached writer (open handles stop writing)."""
        with cls._lock:
            entries, cls._writers = list(cls._writers.values()), {}
        for writer, _ in entries:
            writer.close()


class _SharedWriter(MultiWriter):
    """A handle on a cached writer: writes through; `close()` releases it once.

    Args:
      key: the writer's key in the cache (its absolute logdir).
      writer: the cached writer.
      release: called with `key` on the first `close()`: the cache's bookkeeping.
    """

    def __init__(self, key: str, writer: BackgroundWriter, release: Callable[[str], None]):
        super().__init__([writer])
        self.writer, self._key, self._release, self._open = writer, key, release, True

    def close(self) -> None:
        if self._open:
            self._open = False
            try:
                self.writer.flush()
            finally:
                self._release(self._key)  # the writer and its thread go, even after a failed write

    def __repr__(self) -> str:
        return f"SummaryWriterCache.get({self._key!r})"
