"""Leaf names and flattened dicts, files opened without following a link, a full disk
told apart, and sizes in words."""

import errno
import os
from typing import NamedTuple

import jax
import numpy as np
import pytest

from jaxmon._base.paths import (
    LinkedFileError,
    by_path,
    flatten,
    free_bytes,
    is_full_disk,
    open_fd,
    open_file,
    path_name,
    size_text,
)


class Pair(NamedTuple):
    first: float
    second: float


def test_a_key_path_is_named_by_its_keys_attributes_and_indices():
    tree = {"dense": [Pair(1.0, 2.0)], "bias": np.zeros(2)}
    names = [path_name(path) for path, _ in jax.tree_util.tree_leaves_with_path(tree)]
    assert names == ["bias", "dense/0/first", "dense/0/second"]
    assert path_name(()) == ""
    assert path_name(("raw", 3)) == "raw/3"  # entries without a key, name or idx field: as str


def test_by_path_names_each_leaf_under_the_tag_and_a_leaf_tree_by_the_tag_alone():
    assert by_path("params", {"w": [1.0, 2.0], "b": 0.5}) == {"params/b": 0.5, "params/w/0": 1.0, "params/w/1": 2.0}
    assert by_path("loss", 0.25) == {"loss": 0.25}
    assert by_path("empty", {}) == {}


def test_flatten_joins_the_keys_of_nested_dicts_and_keeps_other_values_whole():
    tree = {"a": {"b": {"c": 1}, "d": [1, 2]}, "e": None}
    assert flatten(tree) == {"a/b/c": 1, "a/d": [1, 2], "e": None}
    assert flatten(tree, ".") == {"a.b.c": 1, "a.d": [1, 2], "e": None}
    assert flatten({"x": 1}, prefix="run/") == {"run/x": 1}


def test_files_are_opened_for_writing_and_appending(tmp_path):
    path = tmp_path / "log.txt"
    with open_file(path, "w", encoding="utf-8") as f:
        f.write("one\n")
    with open_file(path, "a", encoding="utf-8") as f:
        f.write("two\n")
    with open_file(path, "ab") as f:
        f.write(b"three\n")
    assert path.read_text() == "one\ntwo\nthree\n"
    with open_file(path, "w", encoding="utf-8") as f:  # "w" truncates
        f.write("four\n")
    assert path.read_text() == "four\n"


def test_a_link_is_refused_naming_it_and_its_target_which_is_left_alone(tmp_path):
    target = tmp_path / "target.txt"
    target.write_text("precious")
    link = tmp_path / "metrics.jsonl"
    link.symlink_to(target)
    for opened in (lambda: open_file(link, "a"), lambda: open_fd(link, os.O_WRONLY | os.O_CREAT)):
        with pytest.raises(LinkedFileError) as error:
            opened()
        assert error.value.filename == str(link) and error.value.errno is None
        assert str(error.value) == (f"{link} is a symbolic link (to {str(target)!r}), not a file: jaxmon writes no "
                                    "file of a run directory through a link. Remove the link (jaxmon then writes "
                                    "its own file there) and run again.")
    assert target.read_text() == "precious"
    gone = LinkedFileError(str(tmp_path / "gone"))  # a link removed since: the short words
    assert str(gone) == f"{tmp_path / 'gone'} is a symbolic link, not a file: remove it and run again."


def test_a_fresh_file_replaces_a_file_or_a_link_at_its_path(tmp_path):
    target = tmp_path / "target.txt"
    target.write_text("precious")
    path = tmp_path / "copy.tmp"
    path.symlink_to(target)
    with open_file(path, "w", fresh=True, encoding="utf-8") as f:
        f.write("new")
    assert not path.is_symlink() and path.read_text() == "new" and target.read_text() == "precious"
    with open_file(path, "wb", fresh=True) as f:  # an old file: removed, made anew
        f.write(b"newer")
    assert path.read_bytes() == b"newer"
    with open_file(tmp_path / "missing.tmp", "w", fresh=True) as f:
        f.write("x")
    assert (tmp_path / "missing.tmp").read_text() == "x"


def test_other_open_errors_are_raised_as_they_are(tmp_path):
    with pytest.raises(FileNotFoundError):
        open_file(tmp_path / "no" / "such" / "dir.txt")


def test_a_full_disk_is_found_in_the_error_or_anywhere_in_its_chain():
    assert is_full_disk(OSError(errno.EDQUOT, "Disk quota exceeded"))
    assert not is_full_disk(None) and not is_full_disk(ValueError("no errno"))
    try:
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError:
            raise RuntimeError("the save failed")  # noqa: B904 - its context is the full disk
    except RuntimeError as error:
        assert is_full_disk(error)
    hidden = RuntimeError("wrapped")
    hidden.__context__ = OSError(errno.ENOSPC, "No space left on device")
    hidden.__suppress_context__ = True  # `raise ... from None`: the context is not its cause
    assert not is_full_disk(hidden)
    first, second = RuntimeError("a"), RuntimeError("b")
    first.__cause__, second.__cause__ = second, first  # a chain that loops back ends
    assert not is_full_disk(first)


def test_free_bytes_asks_the_nearest_existing_parent(tmp_path):
    here = free_bytes(tmp_path)
    assert isinstance(here, int) and here >= 0
    stat = os.statvfs(tmp_path)
    assert abs(free_bytes(tmp_path / "not" / "yet" / "made") - stat.f_bavail * stat.f_frsize) < 1 << 30


@pytest.mark.parametrize("n, words", [(0, "0 B"), (1023, "1023 B"), (1024, "1.0 KB"), (1536, "1.5 KB"),
                                      (5 * 2**20, "5.0 MB"), (3 * 2**30 // 2, "1.5 GB"), (2**40, "1024.0 GB")])
def test_a_size_is_said_in_the_unit_that_suits_it(n, words):
    assert size_text(n) == words
