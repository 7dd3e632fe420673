"""TensorBoardWriter: TensorBoard event files of tensorboardX's protos."""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from jaxmon._writers.events import EventFile, cut_after, event_files, open_paths
from jaxmon._writers.hparams import flat_hparams

_FILE_NUMBERS = itertools.count()


class TensorBoardWriter:
    """Writes TensorBoard event files into `logdir` (tensorboardX's protos, written in
    the calling thread: no queue, no background thread).

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
        self.logdir = os.fspath(logdir)
        os.makedirs(self.logdir, exist_ok=True)
        # A unique suffix: two writers opened in one second must not share a file name, and
        # their names sort in the order they were opened (TensorBoard reads a directory's
        # files in name order: a restart's file read before the killed run's would put the
        # killed run's events after the restart's), hence the fixed width: ".9" > ".10".
        self._events = EventFile(self.logdir, f".{os.getpid()}.{next(_FILE_NUMBERS):06d}")
        self._clean_after: int | None = None  # the files hold no event after this step (the marker aside)

    def _write(self, step: int, values: Sequence[Any]) -> None:
        from tensorboardX.proto import event_pb2, summary_pb2

        summary = summary_pb2.Summary(value=values)
        self._events.write(event_pb2.Event(wall_time=time.time(), step=step, summary=summary))
        if self._clean_after is not None and step > self._clean_after:
            self._clean_after = None

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
        """A run resumed at `step`: drops every event after `step` (scalars, text,
        histograms, images, session logs) from the event files in `logdir`, this
        writer's own included, leaving out the files of the other writers open in this
        process; then writes TF's `SessionLog.START` at `step + 1`, the first step run
        again (a TensorBoard already reading the files drops its points from there).

        The other event files of `logdir` are taken to be earlier runs' (one run writes
        a directory at a time): their events after `step` are the orphans of a run
        killed after checkpoint `step`. A last record a kill cut short is dropped too.
        """
        from tensorboardX.proto import event_pb2

        if step == self._clean_after:
            return  # one writer shared by several hooks: each hook restarts it
        self._events.flush()
        mine = os.path.realpath(self._events.path)
        others = open_paths() - {mine}  # being written now
        for path in map(os.path.realpath, event_files(self.logdir)):
            if path not in others and cut_after(path, step) and path == mine:
                self._events.reopen()  # the file at its path was replaced
        start = event_pb2.SessionLog(status=event_pb2.SessionLog.START)
        self._events.write(event_pb2.Event(wall_time=time.time(), step=step + 1, session_log=start))
        self._clean_after = step

    def flush(self) -> None:
        """Hands the events written so far to the operating system (no fsync)."""
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
