"""JsonlWriter: scalars as JSON lines, one line per step (metrics.jsonl)."""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from jaxmon._writers.hparams import flat_hparams


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
        flat = flat_hparams(hparams)
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



def _line_step(line: str) -> float:
    """The step of a line of metrics.jsonl; infinite for a line a kill cut short."""
    try:
        step = json.loads(line).get("step")
    except (ValueError, AttributeError):
        return math.inf
    return step if isinstance(step, (int, float)) else -math.inf
