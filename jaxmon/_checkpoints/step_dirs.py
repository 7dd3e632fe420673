"""Which directories of a checkpoint directory are checkpoints: those named by a step in
ASCII digits, as `str(step)` writes it, and complete.

Orbax lists every directory whose name parses as a number (`int()` takes "²" and other
Unicode digits, and an empty directory someone made counts as well), and its own
listing of a local directory takes any directory that is not being written. jaxmon
lists a step only once its commit is on disk: Orbax's commit marker
(`commit_success.txt`, written just before the step directory is renamed into place)
or jaxmon's integrity manifest (`integrity`). The same rule serves `complete_steps`
and, through `CompleteStepNames`, Orbax's `CheckpointManager`: a directory that is not
a checkpoint is never restored, compared against, pruned or deleted.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Iterator
from typing import Any

from jaxmon._checkpoints import integrity as _integrity

logger = logging.getLogger("jaxmon")

#: Orbax's commit marker in a step directory (orbax/checkpoint/_src/path/atomicity_types.py).
COMMIT_MARKER = "commit_success.txt"


def is_step_name(name: str) -> bool:
    """Whether `name` names a step: ASCII digits, as `str(step)` writes the step.

    Example:
      >>> [is_step_name(name) for name in ("0", "120", "0120", "²", "12.orbax-checkpoint-tmp")]
      [True, True, False, False, False]
    """
    return name.isascii() and name.isdigit() and str(int(name)) == name


def is_complete(step_directory: str | os.PathLike) -> bool:
    """Whether a step's directory holds a committed checkpoint (Orbax's commit marker or
    jaxmon's integrity manifest); an empty directory, say, does not."""
    return any(os.path.isfile(os.path.join(step_directory, name)) for name in (COMMIT_MARKER, _integrity.MANIFEST))


def complete_steps(directory: str | os.PathLike) -> list[int]:
    """The steps of the complete checkpoints in `directory`, ascending (Orbax's layout:
    one directory per step, named by the step; one being written carries a suffix).

    Example:
      >>> import pathlib, tempfile
      >>> run = pathlib.Path(tempfile.mkdtemp())
      >>> for name in ("100", "200", "999", "²"):
      ...     (run / name).mkdir()
      >>> for name in ("100", "200"):
      ...     _ = (run / name / COMMIT_MARKER).write_text("committed")
      >>> complete_steps(run)  # 999 is empty, "²" is no step
      [100, 200]
    """
    return [step for step in step_directories(directory) if is_complete(os.path.join(directory, str(step)))]


def step_directories(directory: str | os.PathLike) -> list[int]:
    """The steps that name a directory of `directory`, ascending, complete or not (an empty
    or partial one too: `jaxmon inspect --verify` names those)."""
    try:
        names = os.listdir(directory)
    except (FileNotFoundError, NotADirectoryError):
        return []
    return sorted(int(name) for name in names if is_step_name(name) and os.path.isdir(os.path.join(directory, name)))


def read_meta(step_directory: str | os.PathLike) -> dict[str, Any] | None:
    """The `meta` item of one step's checkpoint (JSON), read without restoring the
    state; None if it is missing or unreadable."""
    try:
        with open(os.path.join(step_directory, "meta", "metadata")) as file:
            meta = json.load(file)
    except (OSError, ValueError):
        return None
    return meta if isinstance(meta, dict) else None


class CompleteStepNames:
    """Orbax's `NameFormat` of jaxmon's step directories: named by the step, as Orbax's
    standard format names them, and listed and found only when `is_step_name` and
    `is_complete` say so (`CheckpointManagerOptions(step_name_format=...)`)."""

    def __init__(self) -> None:
        import orbax.checkpoint as ocp  # here: listing a run's steps (`jaxmon inspect`) needs no Orbax

        self._standard = ocp.path.step.standard_name_format()

    def build_name(self, step: int) -> str:
        return self._standard.build_name(step)

    def find_all(self, base_path: Any) -> Iterator[Any]:
        return (metadata for metadata in self._standard.find_all(base_path) if _counts(metadata.path))

    def find_step(self, base_path: Any, step: int) -> Any:
        metadata = self._standard.find_step(base_path, step)  # ValueError when there is none
        if not _counts(metadata.path):
            raise ValueError(f"No complete checkpoint of step {step} in {base_path}: {metadata.path} has neither "
                             f"{COMMIT_MARKER} nor {_integrity.MANIFEST}.")
        return metadata

    def __repr__(self) -> str:
        return "CompleteStepNames()"


def _counts(path: Any) -> bool:
    return is_step_name(path.name) and is_complete(os.fspath(path))


def disk_bytes(path: str | os.PathLike) -> int:
    """The bytes of every file below `path` (a file removed meanwhile counts none)."""
    total = 0
    for root, _, names in os.walk(path):
        for name in names:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:
                continue
    return total


def unfinished_saves(directory: str | os.PathLike) -> list[str]:
    """The directories of `directory` that saves left under Orbax's temporary name (a
    save cut off before its commit renamed the step into place), sorted."""
    try:
        names = os.listdir(directory)
    except (FileNotFoundError, NotADirectoryError):
        return []
    paths = (os.path.join(directory, name) for name in names if _integrity.TMP_SUFFIX in name)
    return sorted(path for path in paths if os.path.isdir(path) and not os.path.islink(path))


def remove_unfinished_saves(directory: str) -> None:
    """Removes the saves of dead runs that never reached their commit (their temporary
    directories), saying what and how many bytes. Only for a writer that holds the
    directory: no live run writes them then."""
    leftovers = unfinished_saves(directory)
    if not leftovers:
        return
    size = sum(disk_bytes(path) for path in leftovers)
    for path in leftovers:
        shutil.rmtree(path, ignore_errors=True)
    logger.warning("Removed %d unfinished save%s of a run that ended during %s (%s: %.1f MB).", len(leftovers),
                   "s" if len(leftovers) > 1 else "", "them" if len(leftovers) > 1 else "it",
                   ", ".join(os.path.basename(path) for path in leftovers), size / 2**20)
