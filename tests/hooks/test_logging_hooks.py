"""LoggingHook, StepCounterHook and ProgressBarHook: what they log or write, and at which
steps, run in real sessions with a fake clock."""

import io
import itertools
import json
import logging
import re

import jax.numpy as jnp
import numpy as np
import pytest
from helpers import FakeClock, RecordingWriter, count_step, window_means, zero

import jaxmon as jm
from jaxmon._ops import report_thread as _off_loop


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
    there) and taken off, its steps appended to `steps` when given; read once the report
    thread has written every line queued so far."""
    _off_loop.wait()
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
def test_every_n_iter_logs_steps_1_10_20_30_and_a_second_session_from_step_0_repeats_it(logs, at_end):
    hook = jm.LoggingHook(["value"], every_n_iter=10, at_end=at_end, reduce="last")  # TF: the logged step's value
    for _ in range(2):  # the second session starts at step 0 again: the same steps
        logs.clear()
        sess = jm.MonitoredSession(count_step, zero, hooks=[hook])
        run_n(sess, 35)
        sess.close()
        steps = []
        lines = info_lines(logs, steps)
        # step 1 (the starting point), then every 10 steps counted from step 0; the counter after step t is t
        assert [line.split(" (")[0] for line in lines[:4]] == ["value = 1", "value = 10", "value = 20", "value = 30"]
        assert "sec)" not in lines[0] and all(line.endswith("sec)") for line in lines[1:4])  # none on the first
        if at_end:
            assert lines[4:] == ["value = 35"]
            assert steps == [1, 10, 20, 30, 35]
        else:
            assert len(lines) == 4
            assert steps == [1, 10, 20, 30]
    # a session that starts at another step keeps the schedule counted from step 0 (no line at its first step)
    logs.clear()
    sess = jm.MonitoredSession(count_step, zero, hooks=[hook], initial_step=15)
    run_n(sess, 20)  # steps 16..35
    sess.close()
    steps = []
    info_lines(logs, steps)
    assert steps == ([20, 30, 35] if at_end else [20, 30])


def test_lines_carry_the_step_after_the_logged_run_and_a_formatter_may_take_it(logs):
    hook = jm.LoggingHook(["value"], every_n_iter=10, at_end=True, reduce="last")
    sess = jm.MonitoredSession(count_step, zero, hooks=[hook])
    run_n(sess, 25)
    sess.close()
    steps = []
    assert [line.split(" (")[0] for line in info_lines(logs, steps)] == ["value = 1", "value = 10", "value = 20",
                                                                         "value = 25"]
    assert steps == [1, 10, 20, 25]
    logs.clear()
    seen = []
    def with_step(values, step):
        seen.append(step)
        return f"at {step}"

    hooks = [jm.LoggingHook(["value"], every_n_iter=10, formatter=with_step),
             jm.LoggingHook(["value"], every_n_iter=10, formatter=lambda values: f"{values['value']:.1f}")]  # TF's
    sess = jm.MonitoredSession(count_step, zero, hooks=hooks)
    run_n(sess, 15)
    sess.close()
    assert seen == [1, 10]
    # the second formatter gets the means: step 1, then (1 + ... + 10) / 10 = 5.5 (step 1's line ends no window)
    assert [r.getMessage() for r in logs.records if r.name == "jaxmon"] == ["at 1", "1.0", "at 10", "5.5"]


@pytest.mark.parametrize("at_end", [False, True])
def test_every_n_iter_logs_the_mean_of_the_steps_since_the_previous_line(logs, at_end):
    clock = FakeClock()
    hook = jm.LoggingHook(["value"], every_n_iter=10, at_end=at_end, clock=clock)  # reduce="mean", the default
    values = {s: s for s in range(1, 36)}  # the "value" output of steps 1..35: the counter after step t is t
    logged_steps = [1, 10, 20, 30]
    means = window_means(values, logged_steps)  # [1], [1..10], [11..20], [21..30]: step 1's line ends no window
    assert means == [1.0, 5.5, 15.5, 25.5]  # e.g. (1 + 10) / 2 = 5.5
    for _ in range(2):  # the second session (from step 0 again) starts the means afresh
        logs.clear()
        sess = jm.MonitoredSession(count_step, zero, hooks=[hook])
        run_n(sess, 35)
        sess.close()
        steps = []
        lines = info_lines(logs, steps)
        assert steps[:4] == logged_steps
        # 5 significant digits; an int output is averaged as float32 (15.5, not 15)
        assert [line.split(" (")[0] for line in lines[:4]] == ["value = 1", "value = 5.5", "value = 15.5",
                                                               "value = 25.5"]
        assert "sec)" not in lines[0] and all(line.endswith("(0.000 sec)") for line in lines[1:4])  # none on the first
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


def test_every_n_iter_1_lines_after_the_first_have_their_timing(logs):
    clock = FakeClock()
    sess = jm.MonitoredSession(count_step, zero, hooks=[jm.LoggingHook(["value"], every_n_iter=1, clock=clock)])
    clock.t += 2.0  # the first run starts 2 s after the session
    run_n(sess, 3, clock, 0.5)
    sess.close()
    lines = info_lines(logs)
    assert lines == ["value = 1", "value = 2 (0.500 sec)", "value = 3 (0.500 sec)"]  # the first: no timing


@pytest.mark.parametrize("at_end", [False, True])
def test_every_n_secs_logs_when_the_time_has_passed(logs, at_end):
    clock = FakeClock()
    hook = jm.LoggingHook(["value"], every_n_secs=1.0, at_end=at_end, clock=clock, reduce="last")  # TF's values
    sess = jm.MonitoredSession(count_step, zero, hooks=[hook])
    sess.run()  # step 1, the starting point: logged whatever the time
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
    hook = jm.LoggingHook({"zz_loss": "loss", "aa_acc": "acc"}, every_n_iter=1, clock=FakeClock())
    sess = jm.MonitoredSession(metrics_step, zero, hooks=[hook])
    sess.run()
    sess.close()
    assert info_lines(logs) == ["aa_acc = 100, zz_loss = 10"]  # one step's mean, 5 significant digits


def test_list_fetches_log_in_the_given_order(logs):
    hook = jm.LoggingHook(["loss", "acc"], every_n_iter=1, clock=FakeClock())
    sess = jm.MonitoredSession(metrics_step, zero, hooks=[hook])
    sess.run()
    sess.close()
    other = jm.LoggingHook(["acc", "loss"], every_n_iter=1, clock=FakeClock())
    sess = jm.MonitoredSession(metrics_step, zero, hooks=[other])
    sess.run()
    sess.close()
    assert info_lines(logs) == ["loss = 10, acc = 100",
                                "acc = 100, loss = 10"]  # one step's float32 mean


@pytest.mark.parametrize("reduce", ["mean", "last"])
def test_a_callable_fetch_is_logged(logs, reduce):
    clock = FakeClock()
    hook = jm.LoggingHook({"double": double_state, "value": "value"}, every_n_iter=4, at_end=True, reduce=reduce,
                          clock=clock)
    sess = jm.MonitoredSession(count_step, zero, hooks=[hook])
    run_n(sess, 5, clock, 1.0)
    sess.close()
    lines = info_lines(logs)
    assert lines[0] == "double = 2, value = 1"  # step 1
    if reduce == "mean":  # the callable as the named output: the mean over steps 1-4 (step 1's line ends
        # no window), 2 * 2.5 and (1 + 2 + 3 + 4) / 4 = 2.5
        assert window_means({s: s for s in range(1, 6)}, [1, 4]) == [1.0, 2.5]
        assert lines[1] == "double = 5, value = 2.5 (3.000 sec)"
    else:  # the values of step 4
        assert lines[1] == "double = 8, value = 4 (3.000 sec)"
    assert lines[2] == "double = 10, value = 5"  # at_end: both fetched on the final state
    assert len(lines) == 3


def test_values_are_delivered_one_run_late(logs):
    hook = jm.LoggingHook(["value"], every_n_iter=3, clock=FakeClock())
    sess = jm.MonitoredSession(count_step, zero, hooks=[hook])
    sess.run()  # step 1 triggers; its line waits for the next dispatch
    assert info_lines(logs) == []
    sess.run()  # delivers run 1
    assert info_lines(logs) == ["value = 1"]
    sess.run()  # step 3 triggers
    assert info_lines(logs) == ["value = 1"]
    sess.sync()
    # the mean of steps 1 to 3 (step 1's line ends no window): (1 + 2 + 3) / 3 = 2
    assert info_lines(logs) == ["value = 1", "value = 2 (0.000 sec)"]
    sess.sync()  # nothing pending: no duplicate
    sess.close()
    assert len(info_lines(logs)) == 2


def test_floats_are_printed_with_5_significant_digits(logs):
    hook = jm.LoggingHook(["loss"], every_n_iter=1, clock=FakeClock())
    sess = jm.MonitoredSession(float_loss_step, zero, hooks=[hook])
    run_n(sess, 3)
    sess.close()
    lines = info_lines(logs)
    assert lines == ["loss = 1", "loss = 0.5 (0.000 sec)", "loss = 0.33333 (0.000 sec)"]


# -- StepCounterHook ----------------------------------------------------------------------


def test_step_counter_every_n_steps_writes_rates_at_10_20_30(logs):
    clock, writer = FakeClock(), RecordingWriter()
    hook = jm.StepCounterHook(every_n_steps=10, summary_writer=writer, clock=clock)
    sess = jm.MonitoredSession(count_step, zero, hooks=[hook])
    run_n(sess, 30, clock, 0.01)
    sess.close()
    # the clock starts after step 1 (the compiling run): the first rate covers steps 2-10, 9 steps in 0.09 s
    assert writer.steps() == [10, 20, 30]
    assert [sorted(s) for _, s in writer.scalars] == [["global_step/sec"]] * 3
    for _, scalars in writer.scalars:
        assert scalars["global_step/sec"] > 0
        assert scalars["global_step/sec"] == pytest.approx(100.0)
    assert warnings_(logs) == []
    assert sum(line.startswith("global_step/sec: ") for line in info_lines(logs)) == 3
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
    (10, 5, [10, 20]),  # the first run (step 5) starts the clock; then each multiple of 10 passed
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
    _off_loop.wait()  # the rates are written on the report thread
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
    assert [e.step for e in events] == [2, 4]  # step 2: 1 step in 0.5 s; steps 3-4: 2 in 1 s
    assert [e.value for e in events] == [pytest.approx(2.0), pytest.approx(2.0)]
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "global_step/sec" in r] == [2, 4]
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
    # refreshed every 0.2 s from the session's start: first after run 2, with the mean of steps 1-2
    assert "step 2/5" in frames[0] and "loss 0.75" in frames[0]  # (1 + 1 / 2) / 2
    assert not any("step 1/5" in frame for frame in frames)
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


def test_progress_bar_is_drawn_by_rich_in_colour_on_a_terminal_and_plain_elsewhere(monkeypatch):
    monkeypatch.delenv("CI", raising=False)
    for stream, coloured in ((FakeTTY(), True), (io.StringIO(), False)):
        clock = FakeClock()
        bar = jm.ProgressBarHook(stream=stream, enabled=True, clock=clock)
        sess = jm.MonitoredSession(float_loss_step, zero, hooks=[jm.StopAtStepHook(last_step=4), bar])
        run_until_stop(sess, clock)
        sess.close()
        last = [frame for frame in stream.getvalue().split("\r") if frame][-1]
        assert "━" in last and "100.0%  step 4/4" in last  # rich's bar, then the same words as before
        assert ("\x1b[" in last.replace("\x1b[K", "")) is coloured


def regression_step(state, batch):
    return state - 0.01 * batch["x"].T @ (batch["x"] @ state), {"loss": jnp.mean((batch["x"] @ state) ** 2)}


@pytest.mark.parametrize("known", ["examples", "tokens and peak"])
def test_progress_bar_shows_the_training_sessions_perf_figures(tmp_path, known):
    from jaxmon.hooks._throughput import Throughput

    clock, stream = FakeClock(), io.StringIO()
    bar = jm.ProgressBarHook(stream=stream, enabled=True, clock=clock)
    perf = [Throughput(regression_step, tokens_per_step=32 * 128, peak_tflops=1e-3, every_n_steps=5)]
    batch = {"x": np.ones((32, 16), np.float32)}
    sess = jm.MonitoredTrainingSession(regression_step, state=jnp.zeros((16, 1)), data=itertools.repeat(batch),
                                       checkpoint_dir=tmp_path, save_summaries_steps=5,
                                       chief_only_hooks=perf if known != "examples" else None,
                                       hooks=[jm.StopAtStepHook(last_step=20), bar])
    run_until_stop(sess, clock)
    sess.close()
    last = [frame for frame in stream.getvalue().split("\r") if frame][-1]
    if known == "examples":  # the session's own service: examples from the batch's rows, no peak on a CPU
        with open(tmp_path / "metrics.jsonl") as lines:
            figures = [row for row in map(json.loads, lines) if "perf/examples_per_sec" in row][-1]
        assert figures["step"] == 20
        assert f"{figures['perf/examples_per_sec']:.4g} examples/s" in last
        assert "tokens/s" not in last and "MFU" not in last
        from jaxmon._cli.runs import run_info  # `jaxmon inspect` shows the same figure

        assert run_info(str(tmp_path))["metrics"]["perf/examples_per_sec"] == (20, figures["perf/examples_per_sec"])
    else:
        figures = perf[0].figures
        assert figures["perf/tokens_per_sec"] == pytest.approx(32 * 128 * figures["perf/steps_per_sec"])
        assert f"{figures['perf/tokens_per_sec']:.4g} tokens/s" in last and "examples/s" not in last
        assert f"MFU {figures['perf/mfu']:.1%}" in last
    assert f"{figures['perf/tflops_per_sec_per_device']:.3g} TFLOP/s" in last
