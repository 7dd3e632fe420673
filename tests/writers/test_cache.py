"""SummaryWriterCache and MultiWriter: one shared writer (and one event file) per
directory, released with its last handle, fanning out to each writer."""

import os

import pytest
from helpers import (
    FakeClock,
    RecordingWriter,
    event_files,
    event_scalars,
    float_zero,
    read_events,
    read_jsonl,
    summary_step,
)

import jaxmon as jm
from jaxmon._writers import MultiWriter, SummaryWriterCache, default_writer


def test_hooks_with_one_output_dir_share_one_writer_and_one_event_file(tmp_path):
    clock = FakeClock()
    hooks = [
        jm.SummarySaverHook(save_steps=2, output_dir=tmp_path),
        jm.StepCounterHook(every_n_steps=2, output_dir=tmp_path, clock=clock),
    ]
    key = os.path.abspath(tmp_path)
    with jm.MonitoredSession(summary_step, float_zero, hooks=hooks) as sess:
        assert SummaryWriterCache._writers[key][1] == 2  # two handles on one writer
        for _ in range(5):
            sess.run()
            clock.t += 1.0
    assert key not in SummaryWriterCache._writers  # closed and removed with its last handle
    assert len(event_files(tmp_path)) == 1
    acc = read_events(tmp_path)
    assert [s for s, _ in event_scalars(acc, "loss")] == [1, 2, 4]
    # the rate's clock starts after step 1: step 2 over 1 step in 1 s, steps 3-4 in 2 s
    assert event_scalars(acc, "global_step/sec") == [(2, pytest.approx(1.0)), (4, pytest.approx(1.0))]


def test_a_session_that_fails_to_start_releases_the_cached_writer(tmp_path):  # Hook.close: "on every exit"
    def broken_init():
        raise ValueError("no state")

    hook = jm.SummarySaverHook(save_steps=1, output_dir=tmp_path)
    with pytest.raises(ValueError, match="no state"):
        jm.MonitoredSession(summary_step, broken_init, hooks=[hook])
    key = os.path.abspath(tmp_path)
    try:
        assert key not in SummaryWriterCache._writers
    finally:  # do not leak the writer into the other tests
        entry = SummaryWriterCache._writers.pop(key, None)
        if entry is not None:
            entry[0].close()


def test_the_cache_gives_a_fresh_writer_after_the_last_handle_closed(tmp_path):
    first = SummaryWriterCache.get(tmp_path)
    second = SummaryWriterCache.get(tmp_path)
    assert first.writer is second.writer
    first.close()
    first.close()  # a second close of one handle releases nothing more
    assert os.path.abspath(tmp_path) in SummaryWriterCache._writers
    second.close()
    assert os.path.abspath(tmp_path) not in SummaryWriterCache._writers
    third = SummaryWriterCache.get(tmp_path)
    try:
        assert third.writer is not first.writer
    finally:
        third.close()


def test_a_writer_added_to_a_directory_gets_its_writes_and_closes_with_its_shared_writer(tmp_path):
    tracker = RecordingWriter()
    SummaryWriterCache.add_writer(tmp_path, tracker)
    handle = SummaryWriterCache.get(tmp_path)
    handle.write_scalars(3, {"loss": 0.5})
    handle.write_texts(3, {"note": "hello"})
    with pytest.raises(RuntimeError, match="being written already"):
        SummaryWriterCache.add_writer(tmp_path, RecordingWriter())
    handle.close()
    assert [call for call in tracker.calls if call[0] != "flush"] == [
        ("scalars", 3, {"loss": 0.5}), ("texts", 3, {"note": "hello"}), ("close",)]
    [line] = read_jsonl(tmp_path / "metrics.jsonl")
    assert (line["step"], line["loss"], line["note"]) == (3, 0.5, "hello")
    assert event_scalars(read_events(tmp_path), "loss") == [(3, 0.5)]


def test_a_multi_writer_writes_everything_to_each_writer_and_restarts_those_that_can():
    class Restartable(RecordingWriter):
        def restart(self, step):
            self.calls.append(("restart", step))

    plain, restartable = RecordingWriter(), Restartable()
    writer = MultiWriter([plain, restartable])
    writer.write_scalars(1, {"a": 1.0})
    writer.write_histograms(1, {"h": [1.0]})
    writer.write_images(1, {"i": [[0.0]]})
    writer.write_texts(1, {"t": "x"})
    writer.write_hparams({"lr": 0.1})
    writer.restart(1)
    writer.flush()
    writer.close()
    calls = [("scalars", 1, {"a": 1.0}), ("histograms", 1, {"h": [1.0]}), ("images", 1, {"i": [[0.0]]}),
             ("texts", 1, {"t": "x"}), ("hparams", None, {"lr": 0.1})]
    assert plain.calls == [*calls, ("flush",), ("close",)]
    assert restartable.calls == [*calls, ("restart", 1), ("flush",), ("close",)]


def test_the_default_writer_of_a_directory_writes_event_files_and_metrics_jsonl(tmp_path):
    extra = RecordingWriter()
    writer = default_writer(tmp_path, [extra])
    assert [type(w).__name__ for w in writer.writers] == ["TensorBoardWriter", "JsonlWriter", "RecordingWriter"]
    writer.write_scalars(2, {"loss": 0.25})
    writer.close()
    assert len(event_files(tmp_path)) == 1 and event_scalars(read_events(tmp_path), "loss") == [(2, 0.25)]
    assert [line["loss"] for line in read_jsonl(tmp_path / "metrics.jsonl")] == [0.25]
    assert extra.scalars == [(2, {"loss": 0.25})] and extra.closes == 1
