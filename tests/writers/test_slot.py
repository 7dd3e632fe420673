"""WriterSlot: a hook's writer, given (flushed, never closed) or shared by directory, and
the arguments it refuses."""

import os

import pytest
from helpers import RecordingWriter, expected_outputs, run_summaries

import jaxmon as jm
from jaxmon._writers import SummaryWriterCache, WriterSlot


def test_a_writer_with_only_some_of_the_protocol_methods_is_a_type_error():
    class Partial:
        def write_scalars(self, step, scalars):
            pass

        def flush(self):
            pass

    with pytest.raises(TypeError, match="SummaryWriter"):
        jm.SummarySaverHook(save_steps=1, summary_writer=Partial())


def test_a_given_writer_gets_the_scalars_and_is_flushed_but_never_closed():
    writer = RecordingWriter()
    hook = jm.SummarySaverHook(save_steps=2, summary_writer=writer, hparams={"lr": 0.5})
    run_summaries([hook], 5)
    writes = [call for call in writer.calls if call[0] not in ("flush", "close")]
    loss, acc = expected_outputs([1, 2, 4], "mean")  # over steps 1, 1-2, 3-4
    assert loss == [2.0, 3.0, 7.0]  # 2 * 1, 2 * (1 + 2) / 2, 2 * (3 + 4) / 2
    assert writes == [
        ("hparams", None, {"lr": 0.5}),
        ("scalars", 1, {"loss": loss[0], "acc": pytest.approx(acc[0], rel=1e-6)}),
        ("scalars", 2, {"loss": loss[1], "acc": pytest.approx(acc[1], rel=1e-6)}),
        ("scalars", 4, {"loss": loss[2], "acc": pytest.approx(acc[2], rel=1e-6)}),
    ]
    assert ("flush",) in writer.calls[writer.calls.index(writes[-1]):]  # flushed after the last write
    assert ("close",) not in writer.calls


class FakeSession:
    """What a slot reads of a session: its summary directory and the step it restored."""

    def __init__(self, summary_dir=None, restored_step=None):
        self.summary_dir, self.restored_step = summary_dir, restored_step


class RestartedWriter(RecordingWriter):
    def __init__(self):
        super().__init__()
        self.restarts = []

    def restart(self, step):
        self.restarts.append(step)


def test_output_dir_with_summary_writer_or_neither_when_required_is_refused_naming_the_owner():
    with pytest.raises(ValueError, match=r"Owner takes output_dir= or summary_writer=, not both; got output_dir='x'"):
        WriterSlot("Owner", "x", RecordingWriter(), required=False)
    with pytest.raises(ValueError, match="Owner needs somewhere to write"):
        WriterSlot("Owner", None, None, required=True)
    optional = WriterSlot("Owner", None, None, required=False)
    optional.open()
    optional.restarted(FakeSession(restored_step=3))
    optional.close()
    assert optional.writer is None  # nowhere to write, and nothing done


def test_an_output_dir_slot_shares_the_directorys_writer_from_open_to_close(tmp_path):
    first, second = (WriterSlot(name, tmp_path, None, required=True) for name in ("a", "b"))
    assert first.writer is None  # nothing opened before `open`
    first.open()
    second.open()
    key = os.path.abspath(tmp_path)
    assert first.writer.writer is second.writer.writer and SummaryWriterCache._writers[key][1] == 2
    first.close()
    second.close()
    assert first.writer is None and key not in SummaryWriterCache._writers


def test_a_slot_that_follows_the_session_takes_its_summary_dir_and_a_given_writer_is_restarted(tmp_path):
    follower = WriterSlot("o", None, None, required=False, follows_session=True)
    follower.open()
    assert follower.writer is None
    follower.restarted(FakeSession(summary_dir=str(tmp_path)))
    assert os.path.abspath(tmp_path) in SummaryWriterCache._writers
    follower.close()
    assert os.path.abspath(tmp_path) not in SummaryWriterCache._writers

    given = RestartedWriter()
    slot = WriterSlot("o", None, given, required=True, follows_session=True)
    slot.open()
    slot.restarted(FakeSession(summary_dir=str(tmp_path), restored_step=None))
    slot.restarted(FakeSession(summary_dir=str(tmp_path), restored_step=7))
    assert slot.writer is given and given.restarts == [7]  # its own writer kept; told of the restore only
    slot.close()
    assert given.closes == 0 and given.flushes == 1
