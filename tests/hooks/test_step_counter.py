"""StepCounterHook: the rates it writes (steps and examples per second), at which steps,
and where, run in real sessions with a fake clock."""

import json
import re

import jax.numpy as jnp
import numpy as np
import pytest
from helpers import FakeClock, RecordingWriter, all_warnings, count_step, info_lines, run_n, zero

import jaxmon as jm
from jaxmon._ops import report_thread as _off_loop


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
    assert all_warnings(logs) == []
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
    assert all_warnings(logs) == []
    hook.after_run(ctx, jm.RunValues(None, 5))
    [warning] = all_warnings(logs)
    assert re.search("global step.*has not been increased", warning)
    for _ in range(10):  # at most 5 warnings in all
        hook.after_run(ctx, jm.RunValues(None, 5))
    assert len(all_warnings(logs)) == 5


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
    assert not any("has not been increased" in w for w in all_warnings(logs))


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
