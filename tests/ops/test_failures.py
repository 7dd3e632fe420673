"""A session's failures found off its loop (`_ops/failures.py`): one box per session, each
failure raised once, by the session whose work failed and by no other."""

import logging
import threading

import pytest
from helpers import RecordingWriter, count_step, zero

import jaxmon as jm
from jaxmon._ops import failures, report_thread
from jaxmon._writers.background import BackgroundWriter


def test_the_box_raises_its_failures_in_order_one_per_ask():
    box = failures.Failures()
    box.add_error(OSError("first"))
    box.add(lambda step: None)  # its owner raised it already: nothing
    box.add_error(ValueError("second"))
    with pytest.raises(OSError, match="first"):
        box.raise_first(3)
    assert box
    with pytest.raises(ValueError, match="second"):
        box.raise_first(4)
    assert not box
    box.raise_first(5)  # nothing left: returns


def test_a_failure_is_told_the_step_training_stopped_at():
    box, steps = failures.Failures(), []
    box.add(steps.append)
    box.raise_first(7)
    assert steps == [7]


def test_with_a_box_it_is_current_on_that_thread_only_and_nested_boxes_unwind():
    outer, inner, seen = failures.Failures(), failures.Failures(), []
    assert failures.current() is None
    with outer:
        with inner:
            assert failures.current() is inner
            thread = threading.Thread(target=lambda: seen.append(failures.current()))
            thread.start()
            thread.join()
        assert failures.current() is outer
    assert failures.current() is None
    assert seen == [None]  # another thread has no session running


class Reporting(jm.Hook):
    """Reports each run on the report thread; the report of step `fail_at` fails."""

    def __init__(self, fail_at):
        self.fail_at, self.reported = fail_at, []

    def before_run(self, ctx):
        return jm.RunArgs(late=True)

    @report_thread.reports
    def after_run(self, ctx, values):
        if values.step == self.fail_at:
            raise RuntimeError(f"report of step {values.step} failed")
        self.reported.append(values.step)


def test_a_report_failure_is_raised_by_its_own_session_not_by_one_running_beside_it():
    failing, other = Reporting(fail_at=2), Reporting(fail_at=None)
    a = jm.MonitoredSession(count_step, zero, hooks=[failing])
    b = jm.MonitoredSession(count_step, zero, hooks=[other])
    a.run()
    a.run()
    a.run()  # delivers step 2's report to the report thread
    report_thread.wait()
    for _ in range(5):
        b.run()  # B's runs never see A's failure
    b.close()
    assert b.step == 5 and other.reported == [1, 2, 3, 4, 5]
    with pytest.raises(RuntimeError, match="report of step 2 failed") as raised:
        a.run()  # after its step
    assert a.step == 4
    assert "(raised in" in "".join(raised.value.__notes__) and "on the report thread" in "".join(
        raised.value.__notes__)
    a.close()


def test_a_write_that_fails_outside_any_session_is_logged_and_raised_by_the_writers_next_call(caplog):
    class Broken(RecordingWriter):
        def write_scalars(self, step, scalars):
            raise OSError(f"disk full at {step}")

    writer = BackgroundWriter(Broken())
    with caplog.at_level(logging.WARNING, logger="jaxmon"):
        writer.write_scalars(1, {"loss": 1.0})  # no session running: nobody's box
        report_thread.wait()
    with pytest.raises(OSError, match="disk full at 1"):
        writer.wait()
    writer.wait()  # raised once
    sess = jm.MonitoredSession(count_step, zero)
    sess.run()  # a session started afterwards raises nothing of it
    sess.close()


def test_each_failed_write_of_a_session_is_raised_once_the_first_after_a_runs_step_the_rest_at_close():
    class Broken(RecordingWriter):
        def write_scalars(self, step, scalars):
            raise OSError(f"disk full at {step}")

    hook = jm.SummarySaverHook(save_steps=1, summary_writer=Broken())
    sess = jm.MonitoredSession(count_step, zero, hooks=[hook])
    with pytest.raises(OSError, match="disk full at 1"):
        for _ in range(5):
            sess.run()
            report_thread.wait()
    assert sess.step == 3  # step 1's write fails on the report thread during run 2; run 3 raises it
    with pytest.raises(OSError, match="disk full at 2"):  # queued with run 3: nothing is lost
        sess.close()
