"""Which directories of a checkpoint directory are checkpoints: named by a step in ASCII
digits and committed; their meta read without a restore; and the saves a dead run left
unfinished, found and removed."""

import json
import logging

import pytest

from jaxmon._checkpoints import integrity
from jaxmon._checkpoints.step_dirs import (
    COMMIT_MARKER,
    CompleteStepNames,
    complete_steps,
    disk_bytes,
    is_complete,
    is_step_name,
    read_meta,
    remove_unfinished_saves,
    step_directories,
    unfinished_saves,
)


def committed(directory, marker=COMMIT_MARKER):
    directory.mkdir(parents=True)
    (directory / marker).write_text("")
    return directory


@pytest.mark.parametrize("name, step", [("0", True), ("7", True), ("120", True), ("0120", False), ("-1", False),
                                        ("²", False), ("١٢", False), ("12.orbax-checkpoint-tmp-3", False),
                                        ("", False), ("1e3", False)])
def test_a_step_is_named_in_ascii_digits_as_str_writes_it(name, step):
    assert is_step_name(name) is step


def test_a_step_directory_is_complete_with_orbaxs_marker_or_jaxmons_manifest(tmp_path):
    assert is_complete(committed(tmp_path / "1"))
    assert is_complete(committed(tmp_path / "2", integrity.MANIFEST))
    (tmp_path / "3").mkdir()
    assert not is_complete(tmp_path / "3") and not is_complete(tmp_path / "missing")
    (tmp_path / "4").mkdir()
    (tmp_path / "4" / COMMIT_MARKER).mkdir()  # a directory of that name is no marker
    assert not is_complete(tmp_path / "4")


def test_complete_steps_and_step_directories_list_steps_ascending(tmp_path):
    for step in (100, 20, 3):
        committed(tmp_path / str(step))
    (tmp_path / "999").mkdir()  # empty: a step's directory, not a checkpoint
    committed(tmp_path / "0120")  # committed, but no step's name
    committed(tmp_path / "40.orbax-checkpoint-tmp-1")
    (tmp_path / "50").write_text("a file")
    assert complete_steps(tmp_path) == [3, 20, 100]
    assert step_directories(tmp_path) == [3, 20, 100, 999]
    assert complete_steps(tmp_path / "missing") == [] and step_directories(tmp_path / "50") == []


def test_read_meta_gives_the_meta_item_or_none(tmp_path):
    (tmp_path / "5" / "meta").mkdir(parents=True)
    (tmp_path / "5" / "meta" / "metadata").write_text(json.dumps({"step": 5, "data": {"position": 10}}))
    assert read_meta(tmp_path / "5") == {"step": 5, "data": {"position": 10}}
    (tmp_path / "6" / "meta").mkdir(parents=True)
    (tmp_path / "6" / "meta" / "metadata").write_text("[1, 2]")  # JSON, but no dict
    (tmp_path / "7" / "meta").mkdir(parents=True)
    (tmp_path / "7" / "meta" / "metadata").write_text("{cut sho")
    assert [read_meta(tmp_path / step) for step in ("6", "7", "8")] == [None, None, None]


def test_orbax_finds_only_complete_steps_through_the_name_format(tmp_path):
    from etils import epath

    committed(tmp_path / "4")
    (tmp_path / "9").mkdir()  # empty
    names = CompleteStepNames()
    assert names.build_name(12) == "12" and repr(names) == "CompleteStepNames()"
    assert [metadata.step for metadata in names.find_all(epath.Path(tmp_path))] == [4]
    assert names.find_step(epath.Path(tmp_path), 4).step == 4
    with pytest.raises(ValueError, match=rf"No complete checkpoint of step 9 .* has neither {COMMIT_MARKER}"):
        names.find_step(epath.Path(tmp_path), 9)


def test_unfinished_saves_are_found_and_removed_with_a_warning_of_their_size(tmp_path, caplog):
    first = tmp_path / f"7{integrity.TMP_SUFFIX}-1"
    (first / "state").mkdir(parents=True)
    (first / "state" / "data").write_bytes(b"x" * 4096)
    second = tmp_path / f"9{integrity.TMP_SUFFIX}-2"
    second.mkdir()
    (tmp_path / f"file{integrity.TMP_SUFFIX}").write_text("a file, not a save")
    committed(tmp_path / "5")
    assert unfinished_saves(tmp_path) == [str(first), str(second)]
    assert disk_bytes(first) == 4096 and disk_bytes(tmp_path / "5") == 0
    with caplog.at_level(logging.WARNING, logger="jaxmon"):
        remove_unfinished_saves(str(tmp_path))
    assert unfinished_saves(tmp_path) == [] and complete_steps(tmp_path) == [5]
    [warning] = [r.getMessage() for r in caplog.records]
    assert warning == (f"Removed 2 unfinished saves of a run that ended during them ({first.name}, {second.name}: "
                       "0.0 MB).")
    remove_unfinished_saves(str(tmp_path))  # none left: nothing said
    assert len(caplog.records) == 1 and unfinished_saves(tmp_path / "missing") == []
