"""LoggingHook: what it logs, and at which steps, run in real sessions with a fake clock."""

import jax.numpy as jnp
import numpy as np
import pytest
from helpers import FakeClock, count_step, float_loss_step, info_lines, run_n, window_means, zero

import jaxmon as jm


def metrics_step(state, batch):
    """A counter, with integer "loss" and "acc" outputs derived from it."""
    state = state + 1
    return state, {"loss": state * 10, "acc": state * 100}


def double_state(state, batch, outputs):
    return state * 2


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
