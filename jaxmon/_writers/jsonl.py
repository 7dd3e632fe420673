"""JsonlWriter: scalars as JSON lines, one line per step (metrics.jsonl)."""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable, Mapping
from typing import Any, BinaryIO

import numpy as np

from jaxmon._writers.hparams import flat_hparams


class JsonlWriter:
    """Writes scalars as JSON lines, one line per step, for pandas (`read_json(lines=True)`).

    The file: an optional first line `{"hparams": {...}}` (hyper-parameters written at a
    run's start, also in `hparams.json` beside it), then a line per step,
    `{"step": s, "wall_time": t, tag: value, ...}`, in the order written; the writes of
    one step in a row (by several hooks, say) share its line. Text goes on the line too;
    histograms and images are left to TensorBoard. A non-finite value is a string,
    `"nan"`, `"inf"`, `"-inf"`.

    A step's line reaches the file when another step is written, or at `flush()`; a
    write for that step after a flush rewrites the line in place (it is the file's
    last), so the step keeps one line. A last line without its newline is one a kill
    cut short: readers skip it, `restart` drops it, and a new writer starts on a line
    of its own.

    Example:
      >>> import os, tempfile
      >>> path = os.path.join(tempfile.mkdtemp(), "metrics.jsonl")
      >>> writer = JsonlWriter(path)
      >>> writer.write_scalars(1, {"loss": 0.5}); writer.flush(); writer.write_scalars(1, {"acc": 0.9})
      >>> writer.close()
      >>> [sorted(json.loads(line)) for line in open(path)]
      [['acc', 'loss', 'step', 'wall_time']]
    """

    def __init__(self, path: str | os.PathLike, *, clock: Callable[[], float] = time.time):
        self.path = os.fspath(path)
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        self._file = _open(self.path)
        self._clock = clock
        self._step: int | None = None
        self._record: dict[str, Any] = {}  # the current step's line
        self._line_at = 0  # where that line starts in the file, once written
        self._written = b""  # that line as last written (b"": not yet)

    def _at(self, step: int) -> dict[str, Any]:
        if step != self._step:
            self._emit()
            self._step, self._record = step, {"step": step, "wall_time": round(self._clock(), 3)}
            self._written = b""
        return self._record

    def _emit(self) -> None:
        """Writes the current step's line, or rewrites the part of it that changed."""
        line = json.dumps(self._record).encode() + b"\n" if self._record else b""
        if line == self._written:
            return
        if not self._written:
            self._line_at = self._file.tell()
            self._file.write(line)
        else:
            same = len(os.path.commonprefix([self._written, line]))
            self._file.seek(self._line_at + same)
            self._file.write(line[same:])  # the tail that changed: new values are added at the end
            if len(line) < len(self._written):
                self._file.truncate()  # after the new line is whole
        self._written = line

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
        flat = flat_hparams(hparams)
        if self._file.tell() == 0:  # a new file (a step's record still pending comes after)
            self._file.write(json.dumps({"hparams": flat}).encode() + b"\n")
        path = os.path.join(os.path.dirname(os.path.abspath(self.path)), "hparams.json")
        with open(path, "w", encoding="utf-8") as f:
            json.dump(flat, f, indent=1)

    def restart(self, step: int) -> None:
        """A run resumed at `step`: drops the lines an earlier run wrote after it (and a
        last line a kill cut short), so that every step has one line."""
        self.flush()
        self._step, self._record, self._written = None, {}, b""
        with open(self.path, encoding="utf-8") as f:
            lines = f.readlines()
        kept = [line for line in lines if _line_step(line) <= step]
        if len(kept) < len(lines):
            self._file.close()
            temporary = f"{self.path}.{os.getpid()}.tmp"
            with open(temporary, "w", encoding="utf-8") as f:
                f.writelines(kept)
            os.replace(temporary, self.path)
            self._file = _open(self.path)

    def flush(self) -> None:
        """Hands every line, the current step's too, to the operating system (no fsync)."""
        self._emit()
        self._file.flush()

    def close(self) -> None:
        if not self._file.closed:
            self.flush()
            self._file.close()

    def __repr__(self) -> str:
        return f"JsonlWriter({self.path!r})"


def _open(path: str) -> BinaryIO:
    """`path` for writing at its end, in place (not O_APPEND: the last line is rewritten
    in place); after a last line a kill cut short, on a new line."""
    file = os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT, 0o666), "wb")
    if file.seek(0, os.SEEK_END) > 0:
        with open(path, "rb") as f:
            f.seek(-1, os.SEEK_END)
            if f.read(1) != b"\n":
                file.write(b"\n")
    return file


def _line_step(line: str) -> float:
    """The step of a line of metrics.jsonl; infinite for a line a kill cut short."""
    try:
        step = json.loads(line).get("step")
    except (ValueError, AttributeError):
        return math.inf
    return step if isinstance(step, (int, float)) else -math.inf
