"""The writers on a resume and before a checkpoint: `restart(N)` drops every kind of
summary after N from the event files and metrics.jsonl, and `flush_all()` puts what
every open writer holds on disk, read back here by TensorBoard's reader and as JSON."""

import itertools
import json
import os

import numpy as np
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import jaxmon as jm
from jaxmon._writers import SummaryWriterCache, WriterSlot, flush_all, tensorboard
from jaxmon._writers.events import cut_after

KINDS = ("scalars", "tensors", "histograms", "images", "compressedHistograms", "audio")


def events(logdir):
    acc = EventAccumulator(os.fspath(logdir), size_guidance=dict.fromkeys(KINDS, 0))
    acc.Reload()
    return acc


def write_every_kind(writer, steps, run):
    """Steps `steps` of a scalar, a text, a histogram and an image, each marked with `run`."""
    for step in steps:
        writer.write_scalars(step, {"loss": run * 1000 + step})
        writer.write_texts(step, {"sample": f"run {run} step {step}"})
        writer.write_histograms(step, {"weights": np.full(3, float(run))})
        writer.write_images(step, {"picture": np.full((2, 2), run / 2, np.float32)})


def steps_by_kind(acc):
    return {
        "scalars": [(e.step, e.value) for e in acc.Scalars("loss")],
        "text": [(e.step, e.tensor_proto.string_val[0].decode()) for e in acc.Tensors("sample/text_summary")],
        "histograms": [(e.step, e.histogram_value.max) for e in acc.Histograms("weights")],
        "images": [e.step for e in acc.Images("picture")],
    }


def expected(killed_steps, resumed_steps):
    both = [(1, s) for s in killed_steps] + [(2, s) for s in resumed_steps]
    return {
        "scalars": [(s, run * 1000 + s) for run, s in both],
        "text": [(s, f"run {run} step {s}") for run, s in both],
        "histograms": [(s, float(run)) for run, s in both],
        "images": [s for _, s in both],
    }


def jsonl(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


# -- restart drops every kind after N ------------------------------------------------------


# 9: the killed run's file is this process's 10th, the restart's its 11th (".9" sorted after
# ".10" once): TensorBoard reads a directory's files in name order, the restart's first.
@pytest.mark.parametrize("files_opened_before", [0, 9])
def test_a_restart_at_10_drops_every_kind_after_10_from_a_killed_runs_file_and_its_cut_record(
        tmp_path, monkeypatch, files_opened_before):
    monkeypatch.setattr(tensorboard, "_FILE_NUMBERS", itertools.count(files_opened_before))
    killed = jm.TensorBoardWriter(tmp_path)
    write_every_kind(killed, range(1, 16), run=1)
    killed.close()
    (path,) = tmp_path.iterdir()
    os.truncate(path, path.stat().st_size - 7)  # the kill cut step 15's last record short
    resumed = jm.TensorBoardWriter(tmp_path)
    resumed.restart(10)
    write_every_kind(resumed, range(11, 21), run=2)
    resumed.close()
    assert steps_by_kind(events(tmp_path)) == expected(range(1, 11), range(11, 21))
    assert not cut_after(os.fspath(path), 10)  # whole records only: the cut one went
    assert not [name for name in os.listdir(tmp_path) if "tfevents" not in name]  # no temporary left


def test_a_second_resume_before_the_first_resumed_runs_last_step_keeps_each_step_once(tmp_path):
    first = jm.TensorBoardWriter(tmp_path)
    write_every_kind(first, range(1, 16), run=1)
    first.close()
    second = jm.TensorBoardWriter(tmp_path)
    second.restart(10)
    write_every_kind(second, range(11, 26), run=2)
    second.close()
    third = jm.TensorBoardWriter(tmp_path)
    third.restart(20)
    write_every_kind(third, range(21, 31), run=3)
    third.close()
    assert steps_by_kind(events(tmp_path))["text"] == (
        [(s, f"run 1 step {s}") for s in range(1, 11)] + [(s, f"run 2 step {s}") for s in range(11, 21)]
        + [(s, f"run 3 step {s}") for s in range(21, 31)])


def test_a_restart_in_the_same_process_drops_the_writers_own_events_after_the_step(tmp_path):  # a recovery
    writer = jm.TensorBoardWriter(tmp_path)
    write_every_kind(writer, range(1, 16), run=1)
    writer.restart(10)
    writer.restart(10)  # each hook sharing the writer restarts it
    write_every_kind(writer, range(11, 21), run=2)
    writer.close()
    assert len(os.listdir(tmp_path)) == 1
    assert steps_by_kind(events(tmp_path)) == expected(range(1, 11), range(11, 21))


def test_a_restart_leaves_the_files_of_other_open_writers_and_files_of_no_records_alone(tmp_path):
    other = jm.TensorBoardWriter(tmp_path)
    write_every_kind(other, range(1, 16), run=1)
    other.flush()
    (other_file,) = tmp_path.iterdir()
    stray = tmp_path / "events.out.tfevents.0.notes"
    stray.write_bytes(b"not a record")
    before = other_file.read_bytes()
    writer = jm.TensorBoardWriter(tmp_path)
    writer.restart(10)
    writer.close()
    assert other_file.read_bytes() == before and stray.read_bytes() == b"not a record"
    other.close()


def test_a_jsonl_restart_drops_lines_after_the_step_and_a_cut_line_then_each_step_has_one_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    killed = jm.JsonlWriter(path)
    for step in range(1, 16):
        killed.write_scalars(step, {"loss": 1000 + step})
    killed.close()
    with open(path, "a", encoding="utf-8") as f:
        f.write('{"step": 16, "lo')  # a line a kill cut short
    resumed = jm.JsonlWriter(path)
    resumed.restart(10)
    for step in range(11, 21):
        resumed.write_scalars(step, {"loss": 2000 + step})
    resumed.close()
    assert [(line["step"], line["loss"]) for line in jsonl(path)] == (
        [(s, 1000 + s) for s in range(1, 11)] + [(s, 2000 + s) for s in range(11, 21)])


def test_a_jsonl_writer_opened_after_a_cut_line_writes_on_a_line_of_its_own(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 1.0}\n{"step": 2, "lo')
    writer = jm.JsonlWriter(path)
    writer.write_scalars(3, {"loss": 3.0})
    writer.close()
    assert path.read_text().splitlines()[1:] == ['{"step": 2, "lo', json.dumps(jsonl_last(path))]
    assert jsonl_last(path)["loss"] == 3.0


def jsonl_last(path):
    return json.loads(path.read_text().splitlines()[-1])


# -- flush_all -----------------------------------------------------------------------------


def test_flush_all_puts_every_open_writers_pending_records_on_disk(tmp_path):
    shared = WriterSlot("shared", tmp_path / "shared", None, required=False)
    given = WriterSlot("given", None, jm.JsonlWriter(tmp_path / "given.jsonl"), required=False)
    board = WriterSlot("board", None, jm.TensorBoardWriter(tmp_path / "board"), required=False)
    slots = [shared, given, board]
    for slot in slots:
        slot.open()
    try:
        for slot in slots:
            slot.writer.write_scalars(3, {"loss": 0.5})
            slot.writer.write_texts(3, {"sample": "abc"})
        flush_all()
        # Read back by other readers, the writers still open.
        for path in (tmp_path / "shared" / "metrics.jsonl", tmp_path / "given.jsonl"):
            assert [(line["step"], line["loss"], line["sample"]) for line in jsonl(path)] == [(3, 0.5, "abc")]
        for logdir in (tmp_path / "shared", tmp_path / "board"):
            acc = events(logdir)
            assert [(e.step, e.value) for e in acc.Scalars("loss")] == [(3, 0.5)]
            assert [e.step for e in acc.Tensors("sample/text_summary")] == [3]
    finally:
        for slot in slots:
            slot.close()
        given.given.close()
        board.given.close()


def test_writes_of_a_step_after_a_flush_extend_its_one_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    writer = jm.JsonlWriter(path)
    writer.write_scalars(1, {"loss": 0.5})
    writer.write_texts(1, {"sample": "a long text"})
    writer.flush()
    writer.write_scalars(1, {"acc": 0.25})
    writer.flush()
    assert [(line["step"], line["loss"], line["acc"]) for line in jsonl(path)] == [(1, 0.5, 0.25)]
    writer.write_texts(1, {"sample": "short"})  # a shorter line leaves no bytes of the longer one
    writer.write_scalars(2, {"loss": 0.75})
    writer.close()
    lines = jsonl(path)
    assert [(line["step"], line.get("sample")) for line in lines] == [(1, "short"), (2, None)]
    assert path.read_text().endswith("}\n")


def test_flush_all_skips_closed_slots_and_writers_released_by_the_cache(tmp_path):
    slot = WriterSlot("shared", tmp_path, None, required=False)
    slot.open()
    slot.writer.write_scalars(1, {"loss": 0.5})
    slot.close()
    flush_all()
    assert os.path.abspath(tmp_path) not in SummaryWriterCache._writers
    assert [line["step"] for line in jsonl(tmp_path / "metrics.jsonl")] == [1]
