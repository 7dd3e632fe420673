"""TensorBoardWriter: TensorBoard event files, written through tensorboardX's protos."""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from jaxmon._writers.hparams import flat_hparams

_FILE_NUMBERS = itertools.count()


class TensorBoardWriter:
    """Writes TensorBoard event files into `logdir` (tensorboardX's protos and record
    writer, written in the calling thread: no queue, no background thread).

    All values of one call go into one event. Images are HW, HWC or NHWC arrays, floats
    in [0, 1] or uint8. Hyper-parameters go to the HParams dashboard and, as a markdown
    table, to the text dashboard.

    Example:
      >>> import tempfile
      >>> writer = TensorBoardWriter(tempfile.mkdtemp())
      >>> writer.write_scalars(1, {"loss": 0.5})
      >>> writer.close()
    """

    def __init__(self, logdir: str | os.PathLike):
        from tensorboardX.event_file_writer import EventsWriter

        self.logdir = os.fspath(logdir)
        os.makedirs(self.logdir, exist_ok=True)
        # A unique suffix: two writers opened in one second must not share a file name.
        self._events = EventsWriter(os.path.join(self.logdir, "events"), f".{os.getpid()}.{next(_FILE_NUMBERS)}")

    def _write(self, step: int, values: Sequence[Any]) -> None:
        from tensorboardX.proto import event_pb2, summary_pb2

        summary = summary_pb2.Summary(value=values)
        self._events.write_event(event_pb2.Event(wall_time=time.time(), step=step, summary=summary))

    def write_scalars(self, step: int, scalars: Mapping[str, float]) -> None:
        from tensorboardX.proto.summary_pb2 import Summary

        self._write(step, [Summary.Value(tag=tag, simple_value=float(v)) for tag, v in scalars.items()])

    def write_histograms(self, step: int, arrays: Mapping[str, np.ndarray]) -> None:
        from tensorboardX import summary

        self._write(step, [value for tag, array in arrays.items() for value in
                           summary.histogram(tag, np.asarray(array, np.float64).ravel(), "auto").value])

    def write_images(self, step: int, images: Mapping[str, np.ndarray]) -> None:
        from tensorboardX import summary

        values = []
        for tag, image in images.items():
            image = _image(tag, image)
            values += summary.image(tag, image, dataformats="NHWC" if image.ndim == 4 else "HWC").value
        self._write(step, values)

    def write_texts(self, step: int, texts: Mapping[str, str]) -> None:
        from tensorboardX import summary

        self._write(step, [value for tag, text in texts.items() for value in summary.text(tag, str(text)).value])

    def write_hparams(self, hparams: Mapping[str, Any]) -> None:
        from tensorboardX import summary

        flat = flat_hparams(hparams)
        for part in summary.hparams(flat, {}):
            self._write(0, list(part.value))
        table = "\n".join(["| name | value |", "|---|---|", *(f"| {k} | {v} |" for k, v in flat.items())])
        self.write_texts(0, {"hparams": table})

    def restart(self, step: int) -> None:
        """A run resumed at `step`: TF's `SessionLog.START`, so that TensorBoard drops what
        an earlier run wrote after `step` (its orphaned points). TensorBoard drops the
        points at and after the marker's step: `step + 1`, the first step run again."""
        from tensorboardX.proto import event_pb2

        start = event_pb2.SessionLog(status=event_pb2.SessionLog.START)
        self._events.write_event(event_pb2.Event(wall_time=time.time(), step=step + 1, session_log=start))

    def flush(self) -> None:
        self._events.flush()

    def close(self) -> None:
        self._events.close()

    def __repr__(self) -> str:
        return f"TensorBoardWriter({self.logdir!r})"



def _image(tag: str, image: Any) -> np.ndarray:
    image = np.asarray(image)
    if image.ndim == 2:
        image = image[..., None]
    if image.ndim not in (3, 4) or image.shape[-1] not in (1, 3, 4):
        raise ValueError(
            f"Image summary {tag!r} has shape {image.shape}; images are HW, HWC or NHWC arrays "
            "with 1, 3 or 4 channels last."
        )
    return image
