"""Summary writers: a small protocol, TensorBoard and JSON-lines writers, and a shared cache."""

from __future__ import annotations

import itertools
import json
import math
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np

from jaxmon._paths import flatten

_FILE_NUMBERS = itertools.count()


@runtime_checkable
class SummaryWriter(Protocol):
    """What summary-writing hooks need of a writer; values are host NumPy or Python."""

    def write_scalars(self, step: int, scalars: Mapping[str, float]) -> None: ...
    def write_histograms(self, step: int, arrays: Mapping[str, np.ndarray]) -> None: ...
    def write_images(self, step: int, images: Mapping[str, np.ndarray]) -> None: ...
    def write_texts(self, step: int, texts: Mapping[str, str]) -> None: ...
    def write_hparams(self, hparams: Mapping[str, Any]) -> None: ...
    def flush(self) -> None: ...
    def close(self) -> None: ...


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

        flat = _flat_hparams(hparams)
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


class JsonlWriter:
    """Writes scalars as JSON lines, one line per step, for pandas (`read_json(lines=True)`).

    Each line is `{"step": s, "wall_time": t, tag: value, ...}`; scalars written for one
    step by several hooks share its line. Text goes on the line too; histograms and
    images are left to TensorBoard. Hyper-parameters written at a run's start are its
    first line, `{"hparams": {...}}`, and go to `hparams.json` beside the file.

    Example:
      >>> import os, tempfile
      >>> path = os.path.join(tempfile.mkdtemp(), "metrics.jsonl")
      >>> writer = JsonlWriter(path)
      >>> writer.write_scalars(1, {"loss": 0.5}); writer.write_scalars(1, {"acc": 0.9})
      >>> writer.close()
      >>> [sorted(json.loads(line)) for line in open(path)]
      [['acc', 'loss', 'step', 'wall_time']]
    """

    def __init__(self, path: str | os.PathLike, *, clock: Callable[[], float] = time.time):
        self.path = os.fspath(path)
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 (closed in close())
        self._clock = clock
        self._step: int | None = None
        self._record: dict[str, Any] = {}

    def _at(self, step: int) -> dict[str, Any]:
        if step != self._step:
            self._emit()
            self._step, self._record = step, {"step": step, "wall_time": round(self._clock(), 3)}
        return self._record

    def _emit(self) -> None:
        if self._record:
            self._file.write(json.dumps(self._record) + "\n")
            self._record, self._step = {}, None

    def write_scalars(self, step: int, scalars: Mapping[str, float]) -> None:
        record = self._at(step)
        for tag, value in scalars.items():
            value = np.asarray(value).item()
            record[tag] = value if isinstance(value, int) or math.isfinite(value) else str(value)

    def write_histograms(self, step: int, arrays: Mapping[str, np.ndarray]) -> None:
        pass

    def write_images(self, step: int, images: Mapping[str, np.ndarray]) -> None:
        pass

    def write_texts(self, step: int, texts: Mapping[str, str]) -> None:
        self._at(step).update({tag: str(text) for tag, text in texts.items()})

    def write_hparams(self, hparams: Mapping[str, Any]) -> None:
        """The first line of a new file, `{"hparams": {...}}` (flattened: `"model.width"`),
        and `hparams.json` beside it."""
        flat = _flat_hparams(hparams)
        if self._file.tell() == 0:  # a new file (a step's record still pending comes after)
            self._file.write(json.dumps({"hparams": flat}) + "\n")
        path = os.path.join(os.path.dirname(os.path.abspath(self.path)), "hparams.json")
        with open(path, "w", encoding="utf-8") as f:
            json.dump(flat, f, indent=1)

    def restart(self, step: int) -> None:
        """A run resumed at `step`: drops the lines an earlier run wrote after it (and a
        last line a kill cut short), so that every step has one line."""
        self.flush()
        with open(self.path, encoding="utf-8") as f:
            lines = f.readlines()
        kept = [line for line in lines if _line_step(line) <= step]
        if len(kept) < len(lines):
            self._file.close()
            temporary = f"{self.path}.{os.getpid()}.tmp"
            with open(temporary, "w", encoding="utf-8") as f:
                f.writelines(kept)
            os.replace(temporary, self.path)
            self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 (closed in close())

    def flush(self) -> None:
        self._emit()
        self._file.flush()

    def close(self) -> None:
        if not self._file.closed:
            self.flush()
            self._file.close()

    def __repr__(self) -> str:
        return f"JsonlWriter({self.path!r})"


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


def default_writer(logdir: str | os.PathLike) -> MultiWriter:
    """TensorBoard event files in `logdir` plus `logdir/metrics.jsonl`."""
    return MultiWriter([TensorBoardWriter(logdir), JsonlWriter(os.path.join(logdir, "metrics.jsonl"))])


class SummaryWriterCache:
    """One shared writer per directory, so that hooks writing to one `logdir` share one
    event file (TF's `SummaryWriterCache`).

    `get(logdir)` returns a handle on the directory's `default_writer`; closing the
    handle releases it, and the writer closes when its last handle does.

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

    @classmethod
    def get(cls, logdir: str | os.PathLike) -> _SharedWriter:
        key = os.path.abspath(os.fspath(logdir))
        with cls._lock:
            entry = cls._writers.get(key)
            if entry is None:
                entry = cls._writers[key] = [default_writer(key), 0]
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

    def __init__(self, key: str, writer: MultiWriter, release: Callable[[str], None]):
        super().__init__([writer])
        self.writer, self._key, self._release, self._open = writer, key, release, True

    def close(self) -> None:
        if self._open:
            self._open = False
            self.writer.flush()
            self._release(self._key)

    def __repr__(self) -> str:
        return f"SummaryWriterCache.get({self._key!r})"


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



def _flat_hparams(hparams: Mapping[str, Any]) -> dict[str, bool | int | float | str]:
    """Hyper-parameters as one level, `{"model.width": 64}`, each a bool, number or str."""
    return {key: _hparam_value(value) for key, value in flatten(hparams, ".").items()}


def _hparam_value(value: Any) -> bool | int | float | str:
    if isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, np.generic):
        return value.item()
    return str(value)


class WriterSlot:
    """A hook's writer: the one it was given (flushed, never closed by the hook) or the
    shared one of `output_dir` (opened in `begin`, released in `close`)."""

    def __init__(self, owner: str, output_dir: str | os.PathLike | None, summary_writer: Any, required: bool):
        if output_dir is not None and summary_writer is not None:
            raise ValueError(f"{owner} takes output_dir= or summary_writer=, not both; got output_dir="
                             f"{output_dir!r} and summary_writer={summary_writer!r}.")
        if summary_writer is not None and not isinstance(summary_writer, SummaryWriter):
            raise TypeError(f"{owner} summary_writer={summary_writer!r} lacks the SummaryWriter methods "
                            "(write_scalars, write_histograms, write_images, write_texts, write_hparams, "
                            "flush, close); use jm.TensorBoardWriter(dir) or jm.JsonlWriter(path).")
        if required and output_dir is None and summary_writer is None:
            raise ValueError(f"{owner} needs somewhere to write: output_dir= (a directory for TensorBoard "
                             "event files and metrics.jsonl) or summary_writer=.")
        self.output_dir, self.given = output_dir, summary_writer
        self.writer: Any = summary_writer

    def open(self) -> None:
        if self.given is None and self.output_dir is not None and self.writer is None:
            self.writer = SummaryWriterCache.get(self.output_dir)

    def restarted(self, session: Any) -> None:
        """After a session restored a checkpoint: the writer forgets what was written
        after its step (see `TensorBoardWriter.restart`)."""
        if session.restored_step is not None and self.writer is not None:
            restart(self.writer, session.restored_step)

    def close(self) -> None:
        writer = self.writer
        if writer is None:
            return
        if writer is self.given:
            writer.flush()
        else:
            self.writer = None
            writer.close()


def restart(writer: Any, step: int) -> None:
    """`writer.restart(step)` for a writer that has it (a user's writer may not)."""
    method = getattr(writer, "restart", None)
    if callable(method):
        method(step)


def _line_step(line: str) -> float:
    """The step of a line of metrics.jsonl; infinite for a line a kill cut short."""
    try:
        step = json.loads(line).get("step")
    except (ValueError, AttributeError):
        return math.inf
    return step if isinstance(step, (int, float)) else -math.inf
