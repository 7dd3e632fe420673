"""BackgroundWriter: a writer's work on the report thread, the loop only queueing, and a
failed write raised by the session that queued it."""

import json

import numpy as np
import pytest
from helpers import RecordingWriter, float_zero, run_summaries, summary_step

import jaxmon as jm
from jaxmon._ops import report_thread
from jaxmon._writers.background import BackgroundWriter


def test_summaries_are_written_on_the_writers_thread_and_on_disk_at_close(tmp_path, monkeypatch):
    import threading

    from jaxmon._writers.jsonl import JsonlWriter

    threads, write = [], JsonlWriter.write_scalars
    monkeypatch.setattr(JsonlWriter, "write_scalars",
                        lambda self, *args: (threads.append(threading.current_thread().name), write(self, *args))[1])
    run_summaries([jm.SummarySaverHook(save_steps=2, output_dir=tmp_path)], 6)
    assert threads and set(threads) == {"jaxmon-report"}  # the loop only queued them
    steps = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 4, 6]


def test_a_summary_write_that_fails_on_the_writers_thread_stops_the_next_run(tmp_path, monkeypatch):
    import time

    from jaxmon._writers.jsonl import JsonlWriter

    def full(self, step, scalars):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(JsonlWriter, "write_scalars", full)
    hook = jm.SummarySaverHook(save_steps=2, output_dir=tmp_path)
    with pytest.raises(OSError, match="No space left on device") as raised:
        with jm.MonitoredSession(summary_step, float_zero, hooks=[hook]) as sess:
            for _ in range(6):
                sess.run()
                time.sleep(0.2)  # the report thread has written (and failed) before the next run
    # Step 1's summaries are delivered late, written during run 2; run 3 raised after its step.
    assert sess.step == 3
    assert "(raised in" not in "".join(getattr(raised.value, "__notes__", []))  # the writer's, not a hook's


class Failing(RecordingWriter):
    """A writer whose scalar writes fail, as on a full disk."""

    def write_scalars(self, step, scalars):
        raise OSError(28, "No space left on device")


def test_writes_are_done_on_the_report_thread_in_order_with_the_values_as_they_were_queued():
    inner = RecordingWriter()
    writer = BackgroundWriter(inner)
    weights = np.ones(3)
    writer.write_scalars(1, {"loss": np.float32(0.5)})
    writer.write_histograms(1, {"w": weights})
    weights[:] = 7.0  # the buffer reused after the write was queued
    writer.write_texts(2, {"note": "x"})
    writer.wait()
    assert [call[:2] for call in inner.calls] == [("scalars", 1), ("histograms", 1), ("texts", 2)]
    assert inner.scalars == [(1, {"loss": 0.5})]
    np.testing.assert_array_equal(inner.calls[1][2]["w"], np.ones(3))
    writer.flush()
    assert inner.flushes == 1
    writer.close()
    assert inner.closes == 1


def test_hyper_parameters_and_a_restart_are_done_by_the_time_the_call_returns():
    class Restartable(RecordingWriter):
        def restart(self, step):
            self.calls.append(("restart", step))

    inner = Restartable()
    writer = BackgroundWriter(inner)
    writer.write_scalars(1, {"loss": 1.0})
    writer.write_hparams({"lr": 0.1})
    assert [call[0] for call in inner.calls] == ["scalars", "hparams"]  # after what was queued before it
    writer.restart(5)
    assert inner.calls[-1] == ("restart", 5)
    assert repr(writer) == f"BackgroundWriter({inner!r})" and writer.scalars is inner.scalars  # the inner's own
    writer.close()


def test_a_failed_write_is_raised_once_by_the_next_call_which_is_not_queued():
    inner = Failing()
    writer = BackgroundWriter(inner)
    writer.write_scalars(1, {"loss": 1.0})
    report_thread.wait()
    with pytest.raises(OSError, match="No space left on device"):
        writer.write_texts(2, {"note": "lost"})  # the next call raises the failure; this one is not queued
    writer.write_texts(3, {"note": "kept"})
    writer.wait()
    assert inner.calls == [("texts", 3, {"note": "kept"})]
    writer.write_scalars(4, {"loss": 1.0})
    with pytest.raises(OSError):
        writer.close()  # the failure of the last write, and the writer closed all the same
    assert inner.closes == 1
