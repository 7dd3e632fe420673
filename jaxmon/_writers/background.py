"""BackgroundWriter: a writer's work on a thread of its own, off the training loop.

A trigger run's summaries cost the loop only a queue put: the TensorBoard protos, the
CRCs, the JSON lines and the file writes happen on the writer's thread, in order. The
queue is bounded (a loop that writes faster than the disk waits, rather than growing
memory). `flush()` (before every checkpoint, through `flush_all`) and `close()` wait
until everything queued is written; a write that failed is raised after the loop's next
step (`raise_failed_write`), or by the next call made to the writer.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from jaxmon._writers.interface import restart

#: The most writes queued before a write waits for the thread.
MAX_QUEUED = 1000
#: The background writers whose last write failed, until the loop raises it (`raise_failed_write`).
FAILED: list[BackgroundWriter] = []


def raise_failed_write() -> None:
    """Raises the error of a summary write that failed in the background, once; the hook
    runner asks after every run's step (one look at an empty list when none failed)."""
    while FAILED:
        FAILED.pop().wait()


class BackgroundWriter:
    """Writes through `writer` on a daemon thread (see the module's docstring).

    Args:
      writer: the writer that does the work (a `MultiWriter` of TensorBoard and JSON lines).
    """

    def __init__(self, writer: Any):
        self.writer = writer
        self._queue: queue.Queue = queue.Queue(MAX_QUEUED)
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def _submit(self, fn: Callable[..., Any], *args: Any) -> None:
        self._raise_failed()
        if self._thread is None:
            with self._lock:
                if self._thread is None:
                    self._thread = threading.Thread(target=self._work, name="jaxmon-writer", daemon=True)
                    self._thread.start()
        self._queue.put((fn, args))

    def _work(self) -> None:
        while True:
            fn, args = self._queue.get()
            try:
                if fn is None:
                    return
                if self._error is None:  # after a failure, nothing more is written
                    fn(*args)
            except BaseException as error:  # raised from the loop's next run, or its next call
                self._error = error
                FAILED.append(self)
            finally:
                self._queue.task_done()

    def _raise_failed(self) -> None:
        error = self._error
        if error is not None:
            self._error = None
            raise error

    def wait(self) -> None:
        """Waits until every write queued so far is done; raises a write's failure."""
        if self._thread is not None:
            self._queue.join()
        self._raise_failed()

    def write_scalars(self, step: int, scalars: Mapping[str, float]) -> None:
        self._submit(self.writer.write_scalars, step, _host(scalars))

    def write_histograms(self, step: int, arrays: Mapping[str, Any]) -> None:
        self._submit(self.writer.write_histograms, step, _host(arrays))

    def write_images(self, step: int, images: Mapping[str, Any]) -> None:
        self._submit(self.writer.write_images, step, _host(images))

    def write_texts(self, step: int, texts: Mapping[str, str]) -> None:
        self._submit(self.writer.write_texts, step, dict(texts))

    def write_hparams(self, hparams: Mapping[str, Any]) -> None:  # once per run: on disk when it returns
        self.wait()
        self.writer.write_hparams(hparams)

    def restart(self, step: int) -> None:
        self.wait()
        restart(self.writer, step)

    def flush(self) -> None:
        self.wait()
        self.writer.flush()

    def close(self) -> None:
        try:
            self.wait()
        finally:
            thread, self._thread = self._thread, None
            if thread is not None:
                self._queue.put((None, ()))
                thread.join()
            self.writer.close()

    def __getattr__(self, name: str) -> Any:  # the writers of a MultiWriter, a path, ...
        return getattr(self.writer, name)

    def __repr__(self) -> str:
        return f"BackgroundWriter({self.writer!r})"


def _host(values: Mapping[str, Any]) -> dict[str, Any]:
    """`values` as the writer's thread may keep them: each array copied to the host now
    (a device array may be donated to the next step, a NumPy buffer reused)."""
    return {key: np.array(value) if hasattr(value, "__array__") else value for key, value in values.items()}
