"""Names of pytree leaves: a `jax.tree_util` key path as "a/b/c", and nested dicts
flattened by their keys' paths; files of a run directory opened for writing without
following a symbolic link; a full disk told apart, and the room left on it."""

from __future__ import annotations

import errno
import os
from collections.abc import Mapping
from typing import IO, Any

#: The field that names a key path entry: `DictKey.key`, `FlattenedIndexKey.key`,
#: `GetAttrKey.name`, `SequenceKey.idx`, and the same fields of custom key classes.
_FIELDS = ("key", "name", "idx")


def path_name(path: tuple) -> str:
    """A key path as "a/b/c": each entry's key, attribute name or index, joined by "/".

    An entry without a `key`, `name` or `idx` field is written as `str(entry)`; the
    empty path is "".

    Example:
      >>> import jax
      >>> [path_name(path) for path, _ in jax.tree_util.tree_leaves_with_path({"w": [1, 2]})]
      ['w/0', 'w/1']
    """
    return "/".join(_entry_name(entry) for entry in path)


def _entry_name(entry: Any) -> str:
    for field in _FIELDS:
        if hasattr(entry, field):
            return str(getattr(entry, field))
    return str(entry)


def by_path(tag: str, tree: Any) -> dict[str, Any]:
    """The leaves of `tree`, named `tag/path/to/leaf` (just `tag` for a tree that is a leaf).

    Example:
      >>> by_path("params", {"dense": {"b": 0.0, "w": 1.0}})
      {'params/dense/b': 0.0, 'params/dense/w': 1.0}
      >>> by_path("loss", 0.5)
      {'loss': 0.5}
    """
    import jax  # here: the command's paths (opening a run's files) work without loading JAX

    return {f"{tag}/{path_name(path)}" if path else tag: leaf
            for path, leaf in jax.tree_util.tree_leaves_with_path(tree)}


def flatten(tree: Mapping[str, Any], separator: str = "/", prefix: str = "") -> dict[str, Any]:
    """Every value of nested dicts `tree` that is not a dict, by its keys joined with
    `separator`.

    Example:
      >>> flatten({"loss": 1.0, "grads": {"w": 2.0}})
      {'loss': 1.0, 'grads/w': 2.0}
    """
    flat = {}
    for key, value in tree.items():
        if isinstance(value, Mapping):
            flat.update(flatten(value, separator, f"{prefix}{key}{separator}"))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


#: `open()`'s writing modes as `os.open` flags.
_MODES = {"w": os.O_WRONLY | os.O_CREAT | os.O_TRUNC, "a": os.O_WRONLY | os.O_CREAT | os.O_APPEND}


class LinkedFileError(OSError):
    """A file jaxmon writes in a run directory is a symbolic link: jaxmon writes no file
    through a link (it would overwrite the link's target)."""

    def __init__(self, path: str):
        super().__init__(f"{path} is a symbolic link")
        self.filename = path  # no errno: wrappers that name a full disk's file pass it on as it is

    def __str__(self) -> str:
        return (f"{self.filename} is a symbolic link (to {os.readlink(self.filename)!r}), not a file: jaxmon "
                "writes no file of a run directory through a link. Remove the link (jaxmon then writes its "
                "own file there) and run again.") if os.path.islink(self.filename) else (
                f"{self.filename} is a symbolic link, not a file: remove it and run again.")


def open_fd(path: str | os.PathLike, flags: int, permissions: int = 0o666) -> int:
    """`os.open(path, flags, permissions)` for a file jaxmon writes in a run directory,
    with `O_NOFOLLOW`: a symbolic link at `path` is refused (its target is left alone).

    Raises:
      LinkedFileError: `path` is a symbolic link.
    """
    path = os.fspath(path)
    try:
        return os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, permissions)
    except OSError as error:
        if error.errno == errno.ELOOP and os.path.islink(path):
            raise LinkedFileError(path) from None
        raise


def open_file(path: str | os.PathLike, mode: str = "w", *, fresh: bool = False,
              encoding: str | None = None) -> IO[Any]:
    """`open(path, mode)` for a file jaxmon writes in a run directory, never through a
    symbolic link.

    Args:
      path: the file.
      mode: "w", "a", "wb" or "ab".
      fresh: for a temporary file of jaxmon's own name: whatever is at `path` (a file, a
        link) is removed, and the file is created anew (`O_EXCL`).
      encoding: a text mode's encoding.

    Returns:
      The open file.

    Raises:
      LinkedFileError: `path` is a symbolic link (and not `fresh`).

    Example:
      >>> import tempfile
      >>> directory = tempfile.mkdtemp()
      >>> os.symlink(os.devnull, os.path.join(directory, "log"))
      >>> open_file(os.path.join(directory, "log"), "a")
      Traceback (most recent call last):
      jaxmon._base.paths.LinkedFileError: .../log is a symbolic link (to '/dev/null'), not a file: ...
    """
    flags = _MODES[mode.replace("b", "")]
    if fresh:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        flags = (flags & ~os.O_TRUNC) | os.O_EXCL
    return os.fdopen(open_fd(path, flags), mode, encoding=encoding)


#: The OS errors of a full disk: no space left on the device, or the user's quota spent.
FULL_DISK = (errno.ENOSPC, errno.EDQUOT)


def is_full_disk(error: BaseException | None) -> bool:
    """Whether `error`, or an error it was raised from (its cause or context), is a full disk.

    Example:
      >>> is_full_disk(OSError(errno.ENOSPC, "No space left on device"))
      True
      >>> is_full_disk(OSError(errno.EACCES, "Permission denied"))
      False
      >>> try:
      ...     raise RuntimeError("the save failed") from OSError(errno.ENOSPC, "No space left on device")
      ... except RuntimeError as error:
      ...     is_full_disk(error)
      True
    """
    seen: list[BaseException] = []  # a chain that loops back is walked once
    while error is not None and not any(error is earlier for earlier in seen):
        if getattr(error, "errno", None) in FULL_DISK:
            return True
        seen.append(error)
        error = error.__cause__ if error.__cause__ is not None or error.__suppress_context__ else error.__context__
    return False


def free_bytes(path: str | os.PathLike) -> int | None:
    """The bytes free to this user on the disk of `path` (of its nearest existing parent);
    None where the OS cannot say."""
    path = os.path.abspath(os.fspath(path))
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    try:
        stat = os.statvfs(path)
    except (OSError, AttributeError):  # gone meanwhile, or no statvfs on this OS
        return None
    return stat.f_bavail * stat.f_frsize


def size_text(n: float) -> str:
    """`n` bytes in words, the unit chosen to suit: "512 B", "72.0 KB", "1.5 GB".

    Example:
      >>> size_text(512), size_text(73728), size_text(3 * 2**30 // 2)
      ('512 B', '72.0 KB', '1.5 GB')
    """
    if n < 1024:
        return f"{n:.0f} B"
    units = ["KB", "MB", "GB"]
    n /= 1024
    while n >= 1024 and len(units) > 1:
        n /= 1024
        units.pop(0)
    return f"{n:.1f} {units[0]}"
