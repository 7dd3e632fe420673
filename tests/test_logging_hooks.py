"""LoggingHook, StepCounterHook and ProgressBarHook: what they log or write, and at which
steps, run in real sessions with a fake clock."""

import io
import json
import logging
import re

import jax.numpy as jnp
import numpy as np
import pytest
from helpers import FakeClock, RecordingWriter, count_step, window_means, zero

import jaxmon as jm


def metrics_step(state, batch):
    """A counter, with integer "loss" and "acc" outputs derived from it."""
    state = state + 1
    return state, {"loss": state * 10, "acc": state * 100}


def float_loss_step(state, batch):
    state = state + 1
    return state, {"loss": 1.0 / state.astype(jnp.float32)}


def double_state(state, batch, outputs):
    return state * 2


def info_lines(caplog, steps=None):
    """The jaxmon INFO lines; a LoggingHook line's "step N: " prefix is checked (it must be
    there) and taken off, its steps appended to `steps` when given."""
    lines = []
    for r in caplog.records:
        if r.name == "jaxmon" and r.levelno == logging.INFO:
            message = r.getMessage()
            if " = " in message:  # a LoggingHook line in the default format
                match = re.match(r"step (\d+): (.*)", message)
                assert match, message
                if steps is not None:
                    steps.append(int(match[1]))
                message = match[2]
            lines.append(message)
    return lines


def warnings_(caplog):
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


@pytest.fixture
def logs(caplog):
    caplog.set_level(logging.INFO, logger="jaxmon")
    return caplog


def run_n(sess, n, clock=None, dt=0.0, batch=None):
    for _ in range(n):
        sess.run(batch)
        if clock is not None:
            clock.t += dt


# -- LoggingHook ------------------------------------------------------------------------


def test_logging_hook_rejects_bad_arguments():
    for bad in (0, -10):
        with pytest.raises(ValueError, match="invalid every_n_iter"):
            jm.LoggingHook(["value"], every_n_iter=bad)
    with pytest.raises(ValueError, match="exactly one of"):
        jm.LoggingHook(["value"], every_n_iter=10, every_n_secs=1.0)
    with pytest.raises(ValueError, match="exactly one of"):
        jm.LoggingHook(["value"])
    with pytest.raises(ValueError, match="exactly one of"):
        jm.LoggingHook(["value"], at_end=False)
    assert jm.LoggingTensorHook is jm.LoggingHook


def test_at_end_only_logs_nothing_during_runs_and_the_values_at_end(logs):
    hook = jm.LoggingHook(["value"], at_end=True)
    sess = jm.MonitoredSession(count_step, zero, hooks=[hook])
    run_n(sess, 3)
    sess.sync()
    assert info_lines(logs) == []
    sess.close()
    assert info_lines(logs) == ["value = 3"]


@pytest.mark.parametrize("at_end", [False, True])
def test_every_n_iter_logs_iterations_0_10_20_30_and_a_second_session_repeats_it(logs, at_end):
    hook = jm.LoggingHook(["value"], every_n_iter=10, at_end=at_end, reduce="last")  # TF: the logged step's value
    for _ in range(2):  # the second session's begin resets the iteration count
        logs.clear()
        sess = jm.MonitoredSession(count_step, zero, hooks=[hook])
        run_n(sess, 35)
        sess.close()
        lines = info_lines(logs)
        # the counter after iteration i is i + 1
        assert [line.split(" (")[0] for line in lines[:4]] == ["value = 1", "value = 11", "value = 21", "value = 31"]
        assert lines[1].endswith("sec)") and lines[3].endswith("sec)")
        if at_end:
            assert lines[4:] == ["value = 35"]
        else:
            assert len(lines) == 4


def test_lines_carry_the_step_after_the_logged_run_and_a_formatter_may_take_it(logs):
    hook = jm.LoggingHook(["value"], every_n_iter=10, at_end=True, reduce="last")
    sess = jm.MonitoredSession(count_step, zero, hooks=[hook])
    run_n(sess, 25)
    sess.close()
    steps = []
    assert [line.split(" (")[0] for line in info_lines(logs, steps)] == ["value = 1", "value = 11", "value = 21",
                                                                         "value = 25"]
    assert steps == [1, 11, 21, 25]
    logs.clear()
    seen = []
    def with_step(values, step):
        seen.append(step)
        return f"at {step}"

    hooks = [jm.LoggingHook(["value"], every_n_iter=10, formatter=with_step),
             jm.LoggingHook(["value"], every_n_iter=10, formatter=lambda values: f"{values['value']:.0f}")]  # TF's
    sess = jm.MonitoredSession(count_step, zero, hooks=hooks)
    run_n(sess, 15)
    sess.close()
    assert seen == [1, 11]
    assert [r.getMessage() for r in logs.records if r.name == "jaxmon"] == ["at 1", "1", "at 11", "6"]


@pytest.mark.parametrize("at_end", [False, True])
def test_every_n_iter_logs_the_mean_of_the_iterations_since_the_previous_line(logs, at_end):
    hook = jm.LoggingHook(["value"], every_n_iter=10, at_end=at_end)  # reduce="mean", the default
    values = {s: s for s in range(1, 36)}  # the "value" output of steps 1..35: the counter after iteration i is i + 1
    logged_steps = [1, 11, 21, 31]  # iterations 0, 10, 20, 30
    means = window_means(values, logged_steps)  # [1], [2..11], [12..21], [22..31]
    assert means == [1.0, 6.5, 16.5, 26.5]  # e.g. (2 + 11) / 2 = 6.5
    for _ in range(2):  # the second session's begin starts the counts and the means afresh
        logs.clear()
        sess = jm.MonitoredSession(count_step, zero, hooks=[hook])
        run_n(sess, 35)
        sess.close()
        lines = info_lines(logs)
        assert [line.split(" (")[0] for line in lines[:4]] == [f"value = {mean}" for mean in means]
        assert lines[0] == "value = 1.0"  # an int output is averaged as float32
        assert lines[1].endswith("sec)") and lines[3].endswith("sec)")
        if at_end:
            assert lines[4:] == ["value = 35"]  # at_end: the fetch on the final state, not a mean
        else:
            assert len(lines) == 4


@pytest.mark.parametrize("make", [
    lambda reduce: jm.LoggingHook(["value"], every_n_iter=10, reduce=reduce),
    lambda reduce: jm.ProgressBarHook(reduce=reduce),
], ids=["LoggingHook", "ProgressBarHook"])
def test_reduce_other_than_mean_or_last_is_a_value_error_naming_both(make):
    with pytest.raises(ValueError, match="bogus") as info:
        make("bogus")
    assert "'mean'" in str(info.value) and "'last'" in str(info.value)
    for reduce in ("mean", "last"):
        assert make(reduce).reduce == reduce


def test_every_n_iter_1_first_line_has_no_timing_and_later_lines_do(logs):
    sess = jm.MonitoredSession(count_step, zero, hooks=[jm.LoggingHook(["value"], every_n_iter=1)])
    run_n(sess, 3)
    sess.close()
    lines = info_lines(logs)
    assert len(lines) == 3
    assert "value" in lines[0] and "sec" not in lines[0]
    assert lines[1].startswith("value = 2") and "sec" in lines[1]
    assert lines[2].startswith("value = 3") and "sec" in lines[2]


@pytest.mark.parametrize("at_end", [False, True])
def test_every_n_secs_logs_when_the_time_has_passed(logs, at_end):
    clock = FakeClock()
    hook = jm.LoggingHook(["value"], every_n_secs=1.0, at_end=at_end, clock=clock, reduce="last")  # TF's values
    sess = jm.MonitoredSession(count_step, zero, hooks=[hook])
    sess.run()
    sess.sync()
    assert info_lines(logs) == ["value = 1"]
    sess.run()  # same time: no line
    sess.sync()
    assert info_lines(logs) == ["value = 1"]
    clock.t += 1.0
    sess.run()
    sess.sync()
    assert info_lines(logs) == ["value = 1", "value = 3 (1.000 sec)"]
    sess.close()
    assert info_lines(logs)[2:] == (["value = 3"] if at_end else [])


def test_formatter_output_is_the_whole_message(logs):
    def step(state, batch):
        return state, {"qqq": jnp.float32(42.0)}

    hook = jm.LoggingHook(["qqq"], every_n_iter=1, formatter=lambda values: f"qqq={values['qqq']}")
    sess = jm.MonitoredSession(step, zero, hooks=[hook])
    sess.run()
    sess.close()
    assert info_lines(logs) == ["qqq=42.0"]


def test_formatter_gets_a_dict_of_host_values(logs):
    seen = []
    hook = jm.LoggingHook({"l": "loss", "a": "acc"}, every_n_iter=1, formatter=lambda v: seen.append(v) or "x")
    sess = jm.MonitoredSession(metrics_step, zero, hooks=[hook])
    sess.run()
    sess.close()
    assert info_lines(logs) == ["x"]
    assert set(seen[0]) == {"l", "a"} and int(seen[0]["l"]) == 10 and int(seen[0]["a"]) == 100
    assert all(isinstance(v, np.ndarray | np.generic) for v in seen[0].values())


def test_dict_fetches_log_in_sorted_tag_order(logs):
    hook = jm.LoggingHook({"zz_loss": "loss", "aa_acc": "acc"}, every_n_iter=1)
    sess = jm.MonitoredSession(metrics_step, zero, hooks=[hook])
    sess.run()
    sess.close()
    assert info_lines(logs) == ["aa_acc = 100.0, zz_loss = 10.0"]  # one step's mean, as float32


def test_list_fetches_log_in_the_given_order(logs):
    hook = jm.LoggingHook(["loss", "acc"], every_n_iter=1)
    sess = jm.MonitoredSession(metrics_step, zero, hooks=[hook])
    sess.run()
    sess.close()
    other = jm.LoggingHook(["acc", "loss"], every_n_iter=1)
    sess = jm.MonitoredSession(metrics_step, zero, hooks=[other])
    sess.run()
    sess.close()
    assert info_lines(logs) == ["loss = 10.0, acc = 100.0", "acc = 100.0, loss = 10.0"]  # one step's float32 mean


def test_a_callable_fetch_is_logged(logs):
    hook = jm.LoggingHook({"double": double_state, "value": "value"}, every_n_iter=1, at_end=True)
    sess = jm.MonitoredSession(count_step, zero, hooks=[hook])
    run_n(sess, 2)
    sess.close()
    lines = info_lines(logs)
    # the callable is its value at the logged step; the named output the (float32) mean of that one step
    assert lines[0] == "double = 2, value = 1.0"
    assert lines[1].startswith("double = 4, value = 2.0 (")
    assert lines[2] == "double = 4, value = 2"  # at_end: both fetched on the final state


def test_values_are_delivered_one_run_late(logs):
    hook = jm.LoggingHook(["value"], every_n_iter=2)
    sess = jm.MonitoredSession(count_step, zero, hooks=[hook])
    sess.run()  # iteration 0 triggers; its line waits for the next dispatch
    assert info_lines(logs) == []
    sess.run()  # delivers run 1
    assert info_lines(logs) == ["value = 1.0"]
    sess.run()  # iteration 2 triggers
    assert info_lines(logs) == ["value = 1.0"]
    sess.sync()
    # the mean of steps 2 and 3: (2 + 3) / 2 = 2.5
    assert len(info_lines(logs)) == 2 and info_lines(logs)[1].startswith("value = 2.5 (")
    sess.sync()  # nothing pending: no duplicate
    sess.close()
    assert len(info_lines(logs)) == 2


def test_floats_are_printed_without_scientific_notation(logs):
    hook = jm.LoggingHook(["loss"], every_n_iter=1)
    sess = jm.MonitoredSession(float_loss_step, zero, hooks=[hook])
    run_n(sess, 2)
    sess.close()
    lines = info_lines(logs)
    assert lines[0] == "loss = 1.0" and lines[1].startswith("loss = 0.5 (")


# -- StepCounterHook ----------------------------------------------------------------------


def test_step_counter_every_n_steps_writes_rates_at_11_and_21(logs):
    clock, writer = FakeClock(), RecordingWriter()
    hook = jm.StepCounterHook(every_n_steps=10, summary_writer=writer, clock=clock)
    sess = jm.MonitoredSession(count_step, zero, hooks=[hook])
    run_n(sess, 30, clock, 0.01)
    sess.close()
    assert writer.steps() == [11, 21]
    assert [sorted(s) for _, s in writer.scalars] == [["global_step/sec"], ["global_step/sec"]]
    for _, scalars in writer.scalars:
        assert scalars["global_step/sec"] > 0
        assert scalars["global_step/sec"] == pytest.approx(100.0)
    assert warnings_(logs) == []
    assert sum(line.startswith("global_step/sec: ") for line in info_lines(logs)) == 2
    assert writer.flushes >= 1 and writer.closes == 0  # a given writer is flushed, never closed


def test_step_counter_every_n_secs_writes_at_steps_2_and_3():
    clock, writer = FakeClock(), RecordingWriter()
    hook = jm.StepCounterHook(every_n_steps=None, every_n_secs=0.1, summary_writer=writer, clock=clock)
    sess = jm.MonitoredSession(count_step, zero, hooks=[hook])
    run_n(sess, 3, clock, 0.2)
    sess.close()
    assert writer.steps() == [2, 3]
    assert [s["global_step/sec"] for _, s in writer.scalars] == [pytest.approx(5.0), pytest.approx(5.0)]


def test_step_counter_tag():
    clock, writer = FakeClock(), RecordingWriter()
    hook = jm.StepCounterHook(every_n_steps=1, summary_writer=writer, tag="bar/foo/sec", clock=clock)
    sess = jm.MonitoredSession(count_step, zero, hooks=[hook])
    run_n(sess, 3, clock, 0.5)
    sess.close()
    assert writer.steps("bar/foo/sec") == [2, 3] and writer.steps("global_step/sec") == []


def test_step_counter_warns_when_the_step_did_not_advance(logs):
    hook = jm.StepCounterHook(every_n_steps=10, clock=FakeClock())
    ctx = jm.RunContext(4, None, jm.RunArgs())
    hook.after_run(ctx, jm.RunValues(None, 5))
    assert warnings_(logs) == []
    hook.after_run(ctx, jm.RunValues(None, 5))
    [warning] = warnings_(logs)
    assert re.search("global step.*has not been increased", warning)
    for _ in range(10):  # at most 5 warnings in all
        hook.after_run(ctx, jm.RunValues(None, 5))
    assert len(warnings_(logs)) == 5


def test_step_counter_after_a_recovery_starts_a_new_interval_without_warning(logs):
    clock, writer = FakeClock(), RecordingWriter()
    failing = {"left": 1}

    class AbortOnce(jm.Hook):
        def before_run(self, ctx):
            if ctx.step == 3 and failing["left"]:
                failing["left"] -= 1
                raise jm.AbortedError("preempted")

    hook = jm.StepCounterHook(every_n_steps=1, summary_writer=writer, clock=clock)
    sess = jm.MonitoredSession(count_step, zero, hooks=[AbortOnce(), hook])
    run_n(sess, 5, clock, 1.0)
    sess.close()
    # steps 1..3, then a recovery back to 0, then steps 1, 2: each restart's first step only starts the clock
    assert writer.steps() == [2, 3, 2]
    assert not any("has not been increased" in w for w in warnings_(logs))


def test_timer_fires_once_per_interval_when_steps_jump():
    timer = jm.SecondOrStepTimer(every_steps=10)
    fired = []
    for step in (5, 10, 15, 20, 25):
        if timer.should_trigger_for_step(step):
            timer.update_last_triggered_step(step)
            fired.append(step)
    assert fired == [5, 15, 25]


@pytest.mark.parametrize("every_n_steps, steps_per_run, expected", [
    (10, 5, [15, 25]),
    (5, 5, [10, 15, 20, 25]),
    (5, 10, [20, 30, 40, 50]),
])
def test_step_counter_with_steps_that_jump(every_n_steps, steps_per_run, expected):
    clock, writer = FakeClock(), RecordingWriter()
    hook = jm.StepCounterHook(every_n_steps=every_n_steps, summary_writer=writer, clock=clock)
    for i in range(1, 6):
        step = i * steps_per_run
        clock.t += 0.1
        hook.after_run(jm.RunContext(step - steps_per_run, None, jm.RunArgs()), jm.RunValues(None, step))
    assert writer.steps() == expected
    # each rate is the steps since the previous trigger over the time since it: steps_per_run per 0.1 s
    assert [s["global_step/sec"] for _, s in writer.scalars] == [pytest.approx(steps_per_run / 0.1)] * len(expected)


def test_step_counter_writes_examples_per_sec_from_the_batch():
    clock, writer = FakeClock(), RecordingWriter()
    hook = jm.StepCounterHook(every_n_steps=1, summary_writer=writer, clock=clock)
    sess = jm.MonitoredSession(count_step, zero, hooks=[hook])
    run_n(sess, 3, clock, 0.5, batch={"x": np.ones((4, 2)), "y": np.zeros(4)})
    sess.close()
    assert [step for step, _ in writer.scalars] == [2, 3]
    for _, scalars in writer.scalars:
        assert scalars["examples/sec"] == pytest.approx(4 * scalars["global_step/sec"])
        assert scalars["global_step/sec"] == pytest.approx(2.0)


def test_step_counter_counts_the_examples_of_one_step_in_runs_of_several():
    clock, writer = FakeClock(), RecordingWriter()
    hook = jm.StepCounterHook(every_n_steps=4, summary_writer=writer, clock=clock)
    sess = jm.MonitoredSession(lambda s, b: (s + b["x"].sum(), {}), lambda: jnp.zeros(()), hooks=[hook],
                               steps_per_dispatch=4)
    run_n(sess, 3, clock, 0.5, batch=[{"x": np.ones(6, np.float32)}] * 4)
    sess.close()
    assert [step for step, _ in writer.scalars] == [8, 12]
    for _, scalars in writer.scalars:
        assert scalars["global_step/sec"] == pytest.approx(8.0)  # 4 steps per 0.5 s
        assert scalars["examples/sec"] == pytest.approx(6 * 8.0)  # 6 examples a step, not 4 batches a run


def test_step_counter_writes_no_examples_per_sec_without_a_common_leading_dimension():
    clock, writer = FakeClock(), RecordingWriter()
    hook = jm.StepCounterHook(every_n_steps=1, summary_writer=writer, clock=clock)
    sess = jm.MonitoredSession(count_step, zero, hooks=[hook])
    run_n(sess, 3, clock, 0.5, batch={"x": np.ones((4, 2)), "y": np.ones((3,))})
    sess.close()
    assert writer.steps() == [2, 3]
    assert all("examples/sec" not in scalars for _, scalars in writer.scalars)


def test_step_counter_batch_size_argument_overrides_the_batch():
    clock, writer = FakeClock(), RecordingWriter()
    hook = jm.StepCounterHook(every_n_steps=1, summary_writer=writer, batch_size=8, clock=clock)
    sess = jm.MonitoredSession(count_step, zero, hooks=[hook])
    run_n(sess, 3, clock, 0.5, batch={"x": np.ones((4, 2))})
    sess.close()
    assert writer.steps("examples/sec") == [2, 3]
    for _, scalars in writer.scalars:
        assert scalars["examples/sec"] == pytest.approx(8 * scalars["global_step/sec"])


def test_step_counter_output_dir_writes_event_file_and_jsonl(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    clock = FakeClock()
    hook = jm.StepCounterHook(every_n_steps=2, output_dir=tmp_path, clock=clock)
    sess = jm.MonitoredSession(count_step, zero, hooks=[hook])
    run_n(sess, 5, clock, 0.5)
    sess.close()
    acc = EventAccumulator(str(tmp_path))
    acc.Reload()
    events = acc.Scalars("global_step/sec")
    assert [e.step for e in events] == [3, 5]
    assert [e.value for e in events] == [pytest.approx(2.0), pytest.approx(2.0)]
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "global_step/sec" in r] == [3, 5]
    assert records[0]["global_step/sec"] == pytest.approx(2.0)


def test_step_counter_validation():
    with pytest.raises(ValueError, match="exactly one of every_n_steps and every_n_secs"):
        jm.StepCounterHook(every_n_steps=10, every_n_secs=1.0)
    with pytest.raises(ValueError, match="exactly one of every_n_steps and every_n_secs"):
        jm.StepCounterHook(every_n_steps=None)
    with pytest.raises(ValueError, match="exactly one of every_n_steps and every_n_secs"):
        jm.StepCounterHook(every_n_secs=1.0)  # every_n_steps defaults to 100


def test_step_counter_without_a_writer_only_logs(logs):
    clock = FakeClock()
    sess = jm.MonitoredSession(count_step, zero, hooks=[jm.StepCounterHook(every_n_steps=1, clock=clock)])
    run_n(sess, 3, clock, 0.25)
    sess.close()
    assert info_lines(logs) == ["global_step/sec: 4", "global_step/sec: 4"]


# -- ProgressBarHook ----------------------------------------------------------------------


class FakeTTY(io.StringIO):
    def isatty(self):
        return True


def run_until_stop(sess, clock, dt=1.0):
    while not sess.should_stop():
        sess.run()
        clock.t += dt


def test_progress_bar_draws_step_rate_eta_and_loss(logs):
    clock, stream = FakeClock(), io.StringIO()
    bar = jm.ProgressBarHook(stream=stream, enabled=True, clock=clock)
    sess = jm.MonitoredSession(float_loss_step, zero, hooks=[jm.StopAtStepHook(last_step=5), bar])
    run_until_stop(sess, clock)
    assert sess.step == 5
    sess.close()
    text = stream.getvalue()
    frames = [frame for frame in text.split("\r") if frame]
    assert any("step 5/5" in frame for frame in frames)  # total_steps from the StopAtStepHook
    assert "steps/s" in text and "ETA" in text and "loss" in text
    assert any("step 1/5" in frame and "loss 1" in frame for frame in frames)
    assert text.endswith("\n")
    assert warnings_(logs) == []


def test_progress_bar_total_steps_argument_wins():
    clock, stream = FakeClock(), io.StringIO()
    bar = jm.ProgressBarHook(total_steps=10, stream=stream, enabled=True, clock=clock)
    sess = jm.MonitoredSession(float_loss_step, zero, hooks=[jm.StopAtStepHook(last_step=5), bar])
    run_until_stop(sess, clock)
    sess.close()
    assert "step 5/10" in stream.getvalue() and "/5" not in stream.getvalue()


@pytest.mark.parametrize("ci, stream_type", [(None, io.StringIO), ("true", FakeTTY)],
                         ids=["not-a-terminal", "ci-on-a-terminal"])
def test_progress_bar_quiet_off_a_terminal_or_on_ci(monkeypatch, ci, stream_type):
    if ci is None:
        monkeypatch.delenv("CI", raising=False)
    else:
        monkeypatch.setenv("CI", ci)
    clock, stream = FakeClock(), stream_type()
    bar = jm.ProgressBarHook(stream=stream, clock=clock)
    sess = jm.MonitoredSession(float_loss_step, zero, hooks=[jm.StopAtStepHook(last_step=3), bar])
    run_until_stop(sess, clock)
    sess.close()
    assert sess.step == 3 and stream.getvalue() == ""


def test_progress_bar_draws_on_a_terminal_outside_ci(monkeypatch):
    monkeypatch.delenv("CI", raising=False)
    clock, stream = FakeClock(), FakeTTY()
    bar = jm.ProgressBarHook(stream=stream, clock=clock)
    sess = jm.MonitoredSession(float_loss_step, zero, hooks=[jm.StopAtStepHook(last_step=3), bar])
    run_until_stop(sess, clock)
    sess.close()
    text = stream.getvalue()
    assert "step 3/3" in text and "loss" in text and text.endswith("\n")


def test_progress_bar_skips_a_missing_loss(logs):
    clock, stream = FakeClock(), io.StringIO()
    bar = jm.ProgressBarHook(stream=stream, enabled=True, clock=clock)
    sess = jm.MonitoredSession(count_step, zero, hooks=[jm.StopAtStepHook(last_step=3), bar])
    run_until_stop(sess, clock)
    sess.close()
    text = stream.getvalue()
    assert "step 3/3" in text and "steps/s" in text
    assert "loss" not in text
    assert warnings_(logs) == []
