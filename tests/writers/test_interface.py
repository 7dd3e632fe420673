"""The summary writer protocol: which writers satisfy it, `NoArrays` for writers of
scalars and texts only, and `restart` for writers that may lack it."""

import numpy as np
from helpers import RecordingWriter

import jaxmon as jm
from jaxmon._writers.interface import NoArrays, SummaryWriter, restart


def test_the_built_in_writers_and_a_writer_of_every_method_are_summary_writers(tmp_path):
    assert isinstance(RecordingWriter(), SummaryWriter)
    jsonl, board = jm.JsonlWriter(tmp_path / "metrics.jsonl"), jm.TensorBoardWriter(tmp_path)
    try:
        assert isinstance(jsonl, SummaryWriter) and isinstance(board, SummaryWriter)
    finally:
        jsonl.close()
        board.close()


def test_a_writer_lacking_a_method_is_not_a_summary_writer():
    class ScalarsOnly:
        def write_scalars(self, step, scalars):
            pass

        def flush(self):
            pass

        def close(self):
            pass

    assert not isinstance(ScalarsOnly(), SummaryWriter)
    assert not isinstance(object(), SummaryWriter)


def test_no_arrays_takes_histograms_and_images_and_keeps_nothing():
    class Texts(NoArrays):
        def __init__(self):
            self.calls = []

    writer = Texts()
    assert writer.write_histograms(1, {"w": np.ones(3)}) is None
    assert writer.write_images(1, {"picture": np.ones((2, 2))}) is None
    assert writer.calls == [] and vars(writer) == {"calls": []}


def test_restart_calls_a_writers_restart_and_passes_over_a_writer_without_one():
    class Restartable(RecordingWriter):
        def restart(self, step):
            self.calls.append(("restart", step))

    class NotCallable(RecordingWriter):
        restart = "not a method"

    restartable, plain, odd = Restartable(), RecordingWriter(), NotCallable()
    for writer in (restartable, plain, odd):
        restart(writer, 12)
    assert restartable.calls == [("restart", 12)]
    assert plain.calls == [] and odd.calls == []
