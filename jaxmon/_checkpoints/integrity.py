"""Checkpoint integrity: a CRC-32 of every file of a step, recorded as it is written and
checked before it is restored.

Orbax's own checks do not cover a checkpoint's data: with jaxmon's layout (OCDBT, zarr,
uncompressed) a flipped byte in an array's data file restores as a wrong value, with
no error, and zarr3's `crc32c` guards only the index of each shard. So each step
directory gets a manifest, `jaxmon-integrity.json`: the size and CRC-32 of every file
in it (relative paths), but two of Orbax's that its commit rewrites or adds
afterwards (`_CHECKPOINT_METADATA`, `commit_success.txt` at the top). An async save
writes it from Orbax's post-finalization callback, once every process's files are
final and before the directory is renamed into place: a checkpoint is listed with its
manifest or not at all. A synchronous save writes it just after the commit.

A run is sealed from its first checkpoint that carries a manifest, and says so once too,
in `jaxmon-sealed.json` at the top of its checkpoint directory (the first sealed step):
from the earlier of the two on, a checkpoint without a readable manifest is refused as a
changed one is, so deleting a manifest, or the record as well, does not turn the check
off. A checkpoint without a manifest from before (written by plain Orbax, an older
jaxmon, or `integrity=False`) restores unchecked, and a restore says so once; so do all
of a run with no manifest at all.
A file added later is ignored; one changed, shorter, longer or missing, or a manifest
that cannot be read, refuses the checkpoint (`CheckpointChangedError`). What a refusal
says names files, sizes and checksums, never the bytes of a file.
"""

from __future__ import annotations

import glob
import json
import logging
import os
import zlib

from jaxmon._base.paths import open_file

logger = logging.getLogger("jaxmon")

MANIFEST = "jaxmon-integrity.json"
FORMAT = "jaxmon-integrity/1"
#: The checkpoint directory's record that its run seals every checkpoint from a step on.
SEALED_RUN = "jaxmon-sealed.json"
#: Files of the step's top directory that Orbax's commit rewrites or adds after the manifest.
_COMMIT_FILES = ("_CHECKPOINT_METADATA", "commit_success.txt")
#: Orbax's temporary name of a step directory until its commit renames it (orbax/checkpoint/
#: _src/path/atomicity_types.py: TMP_DIR_SUFFIX; older versions added "-<timestamp>").
TMP_SUFFIX = ".orbax-checkpoint-tmp"
_CHUNK = 1 << 20


class CheckpointChangedError(OSError):
    """A checkpoint whose bytes changed after it was written: `step_directory`, and
    `what` failed (a file and its recorded and actual CRC-32 or size)."""

    def __init__(self, step_directory: str | os.PathLike, what: str):
        self.step_directory, self.what = os.fspath(step_directory), what
        parent, step = os.path.split(self.step_directory)
        super().__init__(f"Checkpoint {step} in {parent} is refused: {what}. Restore another step "
                         f"(jm.restore_checkpoint(directory, step=...)); to read this one unchecked, move its "
                         f"{MANIFEST} aside.")


def crc32(path: str) -> int:
    """The CRC-32 (zlib's) of a file's bytes, read 1 MiB at a time (read, not mapped:
    a disk's read error is an OSError, not a SIGBUS; zlib and the reads let go of the
    GIL, so training threads go on meanwhile)."""
    crc, buffer = 0, bytearray(_CHUNK)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as file:
        while size := file.readinto(buffer):
            crc = zlib.crc32(view[:size], crc)
    return crc


def _files(step_directory: str) -> list[str]:
    """The files of a step directory that the manifest covers, as sorted relative paths."""
    names = []
    for root, _, files in os.walk(step_directory):
        names += [os.path.relpath(os.path.join(root, name), step_directory) for name in files]
    skipped = {*_COMMIT_FILES, MANIFEST, MANIFEST + ".tmp"}
    return sorted(name for name in names if name not in skipped)


def seal(step_directory: str | os.PathLike) -> None:
    """Writes the manifest of `step_directory`: each file's size and CRC-32, durably
    (written aside, synced, then renamed into place).

    Example:
      >>> import pathlib, tempfile
      >>> step = pathlib.Path(tempfile.mkdtemp(), "7")
      >>> step.mkdir(); _ = (step / "data").write_bytes(b"checkpoint")
      >>> seal(step); check(step)
      True
      >>> _ = (step / "data").write_bytes(b"Checkpoint")
      >>> check(step)  # doctest: +ELLIPSIS
      Traceback (most recent call last):
      jaxmon._checkpoints.integrity.CheckpointChangedError: Checkpoint 7 in ... is refused: data changed ...
    """
    files = {name: [os.path.getsize(os.path.join(step_directory, name)), crc32(os.path.join(step_directory, name))]
             for name in _files(step_directory)}
    path = os.path.join(step_directory, MANIFEST)
    with open_file(path + ".tmp", "w", fresh=True) as file:
        json.dump({"format": FORMAT, "algorithm": "crc32", "files": files}, file, indent=0)
        file.flush()
        os.fsync(file.fileno())
    os.replace(path + ".tmp", path)


def seal_step(directory: str, step: int) -> None:
    """Seals checkpoint `step` of `directory`: in Orbax's temporary directory while the
    commit has not renamed it yet, else the step's own. Never raises: a checkpoint
    that could not be sealed is logged, and a restore refuses it (its run seals every
    checkpoint): the one before it restores."""
    pending = sorted(glob.glob(os.path.join(glob.escape(directory), f"{step}{TMP_SUFFIX}*")))
    step_directory = next((path for path in pending if os.path.isdir(path)), os.path.join(directory, str(step)))
    try:
        seal(step_directory)
    except Exception as error:  # in Orbax's commit thread: a failure here must not fail the save
        logger.warning("Checkpoint %d in %s is saved without its %s (%r): a restore will refuse it and take the one "
                       "before. Check the disk (space, permissions).", step, directory, MANIFEST, error)


def mark_sealed(directory: str, step: int) -> None:
    """Records in `directory` that its checkpoints are sealed from `step` on (once: a
    record there stands)."""
    path = os.path.join(directory, SEALED_RUN)
    if os.path.exists(path):
        return
    with open_file(path + ".tmp", "w", fresh=True) as file:
        json.dump({"format": FORMAT, "sealed_from": step}, file)
        file.flush()
        os.fsync(file.fileno())
    os.replace(path + ".tmp", path)


def sealed_from(directory: str) -> int | None:
    """The first step `directory`'s run sealed: the earlier of the step its record
    (`jaxmon-sealed.json`) names and the first checkpoint there that carries a manifest
    (None: neither, a run written without manifests). The manifests count on their own,
    so deleting the record does not turn the check off. An unreadable record counts as
    sealed from step 0: the check fails closed."""
    steps = [step for step in (_recorded_seal(directory), _first_manifest(directory)) if step is not None]
    return min(steps, default=None)


def _recorded_seal(directory: str) -> int | None:
    """The first sealed step that `directory`'s `jaxmon-sealed.json` records (None: none there)."""
    try:
        with open(os.path.join(directory, SEALED_RUN)) as file:
            return int(json.load(file)["sealed_from"])
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError):
        logger.warning("%s in %s is unreadable: every checkpoint there must have its %s.", SEALED_RUN, directory,
                       MANIFEST)
        return 0


def _first_manifest(directory: str) -> int | None:
    """The first step of `directory` whose step directory holds a manifest (None: none does)."""
    try:
        names = os.listdir(directory)
    except (FileNotFoundError, NotADirectoryError):
        return None
    steps = sorted((int(name), name) for name in names if name.isascii() and name.isdigit())
    return next((step for step, name in steps if os.path.isfile(os.path.join(directory, name, MANIFEST))), None)


def manifest_required(directory: str, step: int) -> bool:
    """Whether checkpoint `step` of `directory` must have a manifest: its run sealed every
    checkpoint from that step or before (`sealed_from`)."""
    first = sealed_from(directory)
    return first is not None and step >= first


def check(step_directory: str | os.PathLike, required: bool = False) -> bool:
    """Raises `CheckpointChangedError` if a file of `step_directory` differs from its manifest
    (the first such file is named), or if it has no manifest and one is `required`;
    returns whether it had one (False: unchecked)."""
    try:
        with open(os.path.join(step_directory, MANIFEST), "rb") as file:
            files = {name: (int(size), int(crc)) for name, (size, crc) in json.loads(file.read())["files"].items()}
    except FileNotFoundError:
        if required:
            raise CheckpointChangedError(step_directory, f"its {MANIFEST} is missing, and its run seals every "
                                                         "checkpoint") from None
        return False
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:  # its words may quote the bytes
        raise CheckpointChangedError(step_directory, f"its {MANIFEST} is unreadable (not the manifest jaxmon "
                                                     f"writes: {type(error).__name__})") from None
    for name, (size, recorded) in files.items():
        path = os.path.join(step_directory, name)
        try:
            actual = os.path.getsize(path)
        except FileNotFoundError:
            raise CheckpointChangedError(step_directory, f"{name} is missing") from None
        if actual != size:
            raise CheckpointChangedError(step_directory, f"{name} changed after it was written (size {actual} != "
                                                         f"{size} bytes recorded)")
        if (actual := crc32(path)) != recorded:
            raise CheckpointChangedError(step_directory, f"{name} changed after it was written (crc32 {actual:08x} "
                                                         f"!= {recorded:08x} recorded)")
    return True


def verify(step_directory: str, required: bool) -> tuple[str, str]:
    """Re-reads every file of a checkpoint: `("sound", what was read)`, `("changed",
    what differs)` or `("unsealed", what a restore does with it)`; `required`: its run
    seals every checkpoint from before its step."""
    try:
        sealed = check(step_directory)
    except CheckpointChangedError as error:
        return "changed", f"{error.what}: a restore refuses it"
    if not sealed:
        return "unsealed", (f"no {MANIFEST}, and its run seals every checkpoint: a restore refuses it" if required
                            else f"no {MANIFEST} (written without one): it restores unchecked")
    files = _files(step_directory)
    size = sum(os.path.getsize(os.path.join(step_directory, name)) for name in files)
    return "sound", f"{len(files)} files, {size} bytes, each as its {MANIFEST} records"
