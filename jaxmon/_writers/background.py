"""BackgroundWriter: a writer's work on the report thread (`report_thread`), off the training loop.

A trigger run's summaries cost the loop only a queue put: the TensorBoard protos, the
CRCs, the JSON lines and the file writes happen on the report thread, in order. `flush()`
(before every checkpoint, through `flush_all`) and `close()` wait until everything queued
is written; a write that failed is raised by the session that queued it after its
next step (see `failures`), or by the next call made to the writer, whichever is first.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from jaxmon._ops import failures, report_thread
from jaxmon._writers.interface import restart


class BackgroundWriter:
    """Writes through `writer` on the report thread (see the module's docstring).

    Args:
      writer: the writer that does the work (a `MultiWriter` of TensorBoard and JSON lines).
    """

    def __init__(self, writer: Any):
        self.writer = writer
        self._error: BaseException | None = None

    def _submit(self, fn: Callable[..., Any], *args: Any) -> None:
        self._raise_failed()
        report_thread.submit(self._write, fn, args)

    def _write(self, fn: Callable[..., Any], args: tuple) -> None:
        if self._error is not None:  # after a failure, nothing more is written
            return
        try:
            fn(*args)
        except BaseException as error:  # raised from the loop's next run, or its next call
            self._error = error
            box = failures.current()  # the box of the session that queued the write
            if box is not None:
                box.add(lambda step: self._raise_failed())

    def _raise_failed(self) -> None:
        error = self._error
        if error is not None:
            self._error = None
            raise error

    def wait(self) -> None:
        """Waits until every write queued so far is done; raises a write's failure."""
        report_thread.wait()
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
            self.writer.close()

    def __getattr__(self, name: str) -> Any:  # the writers of a MultiWriter, a path, ...
        return getattr(self.writer, name)

    def __repr__(self) -> str:
        return f"BackgroundWriter({self.writer!r})"


def _host(values: Mapping[str, Any]) -> dict[str, Any]:
    """`values` as the report thread may keep them: each array copied to the host now
    (a device array may be donated to the next step, a NumPy buffer reused)."""
    return {key: np.array(value) if hasattr(value, "__array__") else value for key, value in values.items()}
