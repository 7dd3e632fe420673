"""JsonlWriter: scalars as JSON lines, one line per step (metrics.jsonl)."""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import time
from collections.abc import Callable, Mapping
from typing import Any, BinaryIO

import numpy as np

from jaxmon._base.paths import FULL_DISK, open_fd, open_file
from jaxmon._writers.hparams import flat_hparams
from jaxmon._writers.interface import NoArrays


class JsonlWriter(NoArrays):
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
        _remove_stale_copies(self.path)
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

    def write_texts(self, step: int, texts: Mapping[str, str]) -> None:
        self._at(step).update({tag: str(text) for tag, text in texts.items()})

    def write_hparams(self, hparams: Mapping[str, Any]) -> None:
        """The first line of a new file, `{"hparams": {...}}` (flattened: `"model.width"`),
        and `hparams.json` beside it."""
        flat = flat_hparams(hparams)
        if self._file.tell() == 0:  # a new file (a step's record still pending comes after)
            self._file.write(json.dumps({"hparams": flat}).encode() + b"\n")
        path = os.path.join(os.path.dirname(os.path.abspath(self.path)), "hparams.json")
        try:
            with open_file(path, "w", encoding="utf-8") as f:  # a link there is refused
                json.dump(flat, f, indent=1)
        except OSError as error:
            raise _write_error(error, path) from error

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
            try:
                with open_file(temporary, "w", fresh=True, encoding="utf-8") as f:
                    f.writelines(kept)
                os.replace(temporary, self.path)
            except OSError as error:  # a full disk, say: the file as it was stands, the copy goes
                with contextlib.suppress(OSError):
                    os.remove(temporary)
                raise _write_error(error, temporary) from error
            finally:
                self._file = _open(self.path)

    def flush(self) -> None:
        """Hands every line, the current step's too, to the operating system (no fsync)."""
        try:
            self._emit()
            self._file.flush()
        except OSError as error:
            raise _write_error(error, self.path) from error

    def close(self) -> None:
        if not self._file.closed:
            try:
                self.flush()
            finally:
                with contextlib.suppress(OSError):  # what flush() could not write it has raised
                    self._file.close()

    def __repr__(self) -> str:
        return f"JsonlWriter({self.path!r})"


def _open(path: str) -> BinaryIO:
    """`path` for writing at its end, in place (not O_APPEND: the last line is rewritten
    in place); after a last line a kill cut short, on a new line."""
    file = os.fdopen(open_fd(path, os.O_WRONLY | os.O_CREAT), "wb")  # a link at `path` is refused
    if file.seek(0, os.SEEK_END) > 0:
        with open(path, "rb") as f:
            f.seek(-1, os.SEEK_END)
            if f.read(1) != b"\n":
                file.write(b"\n")
    return file


def _write_error(error: OSError, path: str) -> OSError:
    """`error` (an OSError without a file name, as a full disk gives) naming `path` and the fix."""
    if error.errno is None:
        return error
    fix = "free space there" if error.errno in FULL_DISK else "check that disk"
    return OSError(error.errno, f"{error.strerror}, writing {path}: {fix} (or write the run elsewhere) and run again")


def _remove_stale_copies(path: str) -> None:
    """Removes the copies `restart` left beside `path` (`PATH.PID.tmp`) when its process
    died before renaming them into place (a kill, a full disk); those of another live
    process stay. This process's own are stale too (a dead run may have had its pid):
    its `restart` removes or renames its copy before it returns."""
    directory, name = os.path.split(os.path.abspath(path))
    pattern = re.compile(re.escape(name) + r"\.(\d+)\.tmp")
    try:
        names = os.listdir(directory)
    except OSError:
        return
    for other in names:
        match = pattern.fullmatch(other)
        if match and (int(match[1]) == os.getpid() or not _alive(int(match[1]))):
            with contextlib.suppress(OSError):
                os.remove(os.path.join(directory, other))


def _alive(pid: int) -> bool:
    """Whether process `pid` runs on this machine."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True  # another user's, or a number no process has: left alone
    return True


def _line_step(line: str) -> float:
    """The step of a line of metrics.jsonl; infinite for a line a kill cut short."""
    try:
        step = json.loads(line).get("step")
    except (ValueError, AttributeError):
        return math.inf
    return step if isinstance(step, (int, float)) else -math.inf
