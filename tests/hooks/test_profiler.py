"""ProfilerHook: its arguments, and the traces it leaves (never of the first step), by steps
or seconds, through a failing step and a recovery."""

from __future__ import annotations

import os

import jax
import numpy as np
import pytest
from helpers import FakeClock, RecordingHook, checked_summary_step, float_zero, run_summaries, summary_step

import jaxmon as jm


@pytest.mark.parametrize("kwargs", [
    {"output_dir": "x"},
    {"save_steps": 1, "save_secs": 1.0, "output_dir": "x"},
    {"save_steps": 1},
    {"save_steps": 1, "output_dir": ""},
])
def test_profiler_hook_checks_its_arguments(kwargs):
    with pytest.raises(ValueError):
        jm.ProfilerHook(**kwargs)


def stop_any_trace():
    """Leaves no profiler trace running for the other tests, whatever a failed test left."""
    try:
        jax.profiler.stop_trace()
    except RuntimeError:
        pass  # none was running


def traces(output_dir):
    profile = output_dir / "plugins" / "profile"
    return {name: sorted(p.name for p in (profile / name).iterdir()) for name in os.listdir(profile)}


def test_profiler_save_steps_two_traces_steps_2_and_4(tmp_path):
    hook = jm.ProfilerHook(save_steps=2, output_dir=tmp_path)
    run_summaries([hook], 5)
    assert hook.traced_steps == [2, 4]
    found = traces(tmp_path)
    assert sorted(found) == ["step_2", "step_4"]
    assert all(any(name.endswith(".xplane.pb") for name in files) for files in found.values())


def test_profiler_never_traces_the_first_step(tmp_path):
    hook = jm.ProfilerHook(save_steps=1, output_dir=tmp_path)
    run_summaries([hook], 2)
    assert hook.traced_steps == [2]
    assert sorted(traces(tmp_path)) == ["step_2"]


def test_profiler_save_secs_traces_when_two_seconds_have_passed(tmp_path):
    clock = FakeClock(1000.0)
    hook = jm.ProfilerHook(save_secs=2, output_dir=tmp_path, clock=clock)
    with jm.MonitoredSession(summary_step, float_zero, hooks=[hook]) as sess:
        for offset in [0.0, 2.5, 2.6, 4.4, 4.5]:  # TF's test: traced at +2.5 and +4.5 only
            clock.t = 1000.0 + offset
            sess.run()
    assert hook.traced_steps == [2, 5]
    assert sorted(traces(tmp_path)) == ["step_2", "step_5"]


def test_a_step_failing_while_traced_still_stops_and_keeps_the_trace(tmp_path):
    hook = jm.ProfilerHook(save_steps=1, output_dir=tmp_path)
    try:
        with pytest.raises(ValueError, match="scalar batch"):
            with jm.MonitoredSession(checked_summary_step, float_zero, hooks=[hook]) as sess:
                sess.run(np.float32(0))
                sess.run(np.zeros(2, np.float32))  # traced, and fails
        assert hook.traced_steps == [2]
        assert sorted(traces(tmp_path)) == ["step_2"]
        # the profiler was stopped: a new trace can start
        jax.profiler.start_trace(str(tmp_path / "again"))
        jax.profiler.stop_trace()
    finally:
        stop_any_trace()


def test_a_recovery_during_a_traced_run_does_not_break_the_session(tmp_path):
    aborter = RecordingHook(raise_in={"before_run": (2, jm.AbortedError("preempted"))})
    hook = jm.ProfilerHook(save_steps=1, output_dir=tmp_path)
    try:
        with jm.MonitoredSession(summary_step, float_zero, hooks=[hook, aborter]) as sess:
            for _ in range(3):
                sess.run()  # run 2 starts a trace, then aborts; the session re-creates the state and retries
        assert aborter.calls["after_create_session"] == 2
        assert sess.step == 2
        assert hook.traced_steps and all(f"step_{s}" in traces(tmp_path) for s in hook.traced_steps)
        jax.profiler.start_trace(str(tmp_path / "again"))  # no trace left running
        jax.profiler.stop_trace()
    finally:
        stop_any_trace()
