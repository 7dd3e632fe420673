"""The report thread: the built-in hooks that only report (LoggingHook, SummarySaverHook,
StepCounterHook, GoodputHook) format, log and write on `jaxmon-report`, in order; the
loop waits for them only at `sync()`, saves and close; their failures follow the hook's
`on_error`, raised on the loop after a later run's step; a subclass that overrides
`after_run` is called on the loop as before."""

import logging
import threading

import pytest
from helpers import FakeClock, RecordingWriter, count_step, zero

import jaxmon as jm
from jaxmon._ops import report_thread as _off_loop


def formatter_on(threads, fail_at=None):
    def formatter(values):
        threads.append(threading.current_thread().name)
        if values["value"] == fail_at:
            raise RuntimeError(f"cannot format {values['value']}")
        return f"value is {values['value']}"

    return formatter


def test_a_logging_hooks_lines_are_formatted_and_logged_on_the_report_thread(caplog):
    threads = []
    hook = jm.LoggingHook(["value"], every_n_iter=2, formatter=formatter_on(threads), reduce="last",
                          clock=FakeClock())
    with caplog.at_level(logging.INFO, logger="jaxmon"):
        sess = jm.MonitoredSession(count_step, zero, hooks=[hook])
        for _ in range(6):
            sess.run()
        sess.sync()
        lines = [r for r in caplog.records if r.getMessage().startswith("value is")]
        assert [r.getMessage() for r in lines] == ["value is 1", "value is 2", "value is 4", "value is 6"]
        assert {r.threadName for r in lines} == {"jaxmon-report"}
        sess.close()
    assert threads == ["jaxmon-report"] * 4  # steps 1, 2, 4 and 6 (its line at sync)


def test_a_report_that_fails_is_raised_on_the_loop_after_a_later_run_naming_the_hook_and_step():
    threads = []
    hook = jm.LoggingHook(["value"], every_n_iter=2, formatter=formatter_on(threads, fail_at=4), reduce="last",
                          clock=FakeClock())
    sess = jm.MonitoredSession(count_step, zero, hooks=[hook])
    with pytest.raises(RuntimeError, match="cannot format 4") as raised:
        for _ in range(10):
            sess.run()
            _off_loop.wait()  # the report of step 4 is done before the next run: raised after that run's step
    assert sess.step == 6  # step 4's report is queued at run 5 and raised after run 6's step
    assert any("at step 4, on the report thread" in note for note in raised.value.__notes__)
    sess.close()


def test_a_report_that_fails_under_warn_is_logged_and_training_goes_on(caplog):
    threads = []
    hook = jm.LoggingHook(["value"], every_n_iter=2, formatter=formatter_on(threads, fail_at=4), reduce="last",
                          on_error="warn", clock=FakeClock())
    with caplog.at_level(logging.WARNING, logger="jaxmon"):
        sess = jm.MonitoredSession(count_step, zero, hooks=[hook])
        for _ in range(8):
            sess.run()
        sess.close()
    assert sess.step == 8
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("after_run failed at step 4" in message and "cannot format 4" in message for message in warned)


def test_sync_and_close_wait_for_every_report():
    writer = RecordingWriter()
    hook = jm.SummarySaverHook(save_steps=1, summary_writer=writer, summaries={"value": "value"}, reduce="last")
    sess = jm.MonitoredSession(count_step, zero, hooks=[hook])
    for _ in range(3):
        sess.run()
    sess.sync()
    assert writer.steps("value") == [1, 2, 3]
    sess.run()
    sess.close()
    assert writer.steps("value") == [1, 2, 3, 4]


def test_the_step_counters_rate_is_written_off_the_loop():
    class ThreadOf(RecordingWriter):
        def write_scalars(self, step, scalars):
            self.threads.append(threading.current_thread().name)
            super().write_scalars(step, scalars)

    writer, clock = ThreadOf(), FakeClock()
    writer.threads = []
    hook = jm.StepCounterHook(every_n_steps=2, summary_writer=writer, clock=clock)
    sess = jm.MonitoredSession(count_step, zero, hooks=[hook])
    for _ in range(6):
        clock.t += 0.5
        sess.run()
    sess.close()
    assert writer.steps() == [2, 4, 6] and set(writer.threads) == {"jaxmon-report"}


def test_a_subclass_that_overrides_after_run_is_called_on_the_loop():
    threads = []

    class Mine(jm.LoggingHook):
        def after_run(self, run_context, run_values):
            threads.append(threading.current_thread().name)
            super().after_run(run_context, run_values)

    sess = jm.MonitoredSession(count_step, zero, hooks=[Mine(["value"], every_n_iter=1, clock=FakeClock())])
    for _ in range(3):
        sess.run()
    sess.close()
    assert threads == [threading.current_thread().name] * 3


def test_a_failure_of_work_queued_outside_a_session_is_logged_and_no_session_raises_it(caplog):
    def fails():
        raise RuntimeError("oops after the end")

    with caplog.at_level(logging.WARNING, logger="jaxmon"):
        _off_loop.submit(fails)  # as work queued after a session has ended
        _off_loop.wait()
        sess = jm.MonitoredSession(count_step, zero)
        sess.run()
        sess.close()
    assert sess.step == 1
    assert any("with no session running" in r.getMessage() and "oops after the end" in r.getMessage()
               for r in caplog.records)


@pytest.mark.parametrize("on_error", ["raise", "warn"])
def test_a_step_counter_whose_write_fails_follows_its_on_error(on_error, caplog):
    class Broken(RecordingWriter):
        def write_scalars(self, step, scalars):
            raise OSError(f"disk full at {step}")

    clock = FakeClock()
    hook = jm.StepCounterHook(every_n_steps=2, summary_writer=Broken(), clock=clock, on_error=on_error)
    sess = jm.MonitoredSession(count_step, zero, hooks=[hook])
    with caplog.at_level(logging.WARNING, logger="jaxmon"):
        if on_error == "raise":
            with pytest.raises(OSError, match="disk full at 2"):
                for _ in range(6):
                    clock.t += 0.5
                    sess.run()
                    _off_loop.wait()
            assert sess.step == 3  # the rate of step 2 fails on the report thread; raised after the next run
        else:
            for _ in range(6):
                clock.t += 0.5
                sess.run()
            assert sess.step == 6
        sess.close()
    warned = [r.getMessage() for r in caplog.records if "failed to report" in r.getMessage()]
    assert (len(warned) == 3 and "disk full at 2" in warned[0]) if on_error == "warn" else warned == []
