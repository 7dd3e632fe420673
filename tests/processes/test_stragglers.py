"""Stragglers: a process slower than the median of the others at three agreements in a
row named once (and its figures written), noise and equal processes never, and a
process's host time measured without its hooks' events."""

import json
import math

import pytest

import jaxmon as jm
from jaxmon._processes.stragglers import Stragglers


def test_a_process_slower_than_the_median_at_three_agreements_in_a_row_is_named_once(caplog, tmp_path):
    stragglers = Stragglers()
    with caplog.at_level("WARNING", logger="jaxmon"):
        for step in range(16, 16 * 8, 16):
            stragglers.agreed(step, [0.004, 0.004, 0.030, 0.005], summary_dir=str(tmp_path))
        stragglers.agreed(200, [0.004, 0.004, 0.004, 0.005])  # caught up
    said = [r.getMessage() for r in caplog.records]
    assert said == ["Process 2 is a straggler: 30.0 ms of host time per step, 7.5x the median of the other 3 "
                    "processes (4.0 ms), at the last 3 agreements up to step 48; the others wait for it."], said
    jm.SummaryWriterCache.clear()
    [record] = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert record["step"] == 48 and record["stragglers/slowest_process"] == 2.0
    assert record["stragglers/process_2_ms_per_step"] == pytest.approx(30.0)


def test_noise_below_two_milliseconds_per_step_is_no_straggler(caplog):
    stragglers = Stragglers()
    with caplog.at_level("WARNING", logger="jaxmon"):
        for step in range(10):
            stragglers.agreed(step, [0.0001, 0.0009])  # 9x, but only 0.8 ms more
    assert not caplog.records


def test_of_two_processes_the_one_slower_than_the_other_is_named_and_equal_ones_never(caplog):
    stragglers = Stragglers()
    with caplog.at_level("WARNING", logger="jaxmon"):
        for step in range(0, 160, 16):
            stragglers.agreed(step, [0.005, 0.005])
        for step in range(160, 208, 16):
            stragglers.agreed(step, [0.005, 0.011])  # 2.2x: with a median of both, never more than 2x
    assert [r.getMessage() for r in caplog.records] == [
        "Process 1 is a straggler: 11.0 ms of host time per step, 2.2x the median of the other process (5.0 ms), "
        "at the last 3 agreements up to step 192; the others wait for it."]


def test_a_process_s_host_time_leaves_out_its_hooks_events(monkeypatch):
    """The chief runs hooks the others do not (summaries, logs): their seconds are not slowness."""
    from jaxmon._processes import stragglers as module

    clock = [100.0]
    monkeypatch.setattr(module.time, "monotonic", lambda: clock[0])
    stragglers = module.Stragglers()
    stragglers.agreed(16, [0.001, 0.001], hook_secs=2.0)  # 2 s of hooks before this agreement
    clock[0] += 0.5  # 16 steps: 0.1 s of its own work, 0.4 s in its hooks' events
    assert stragglers.measure(32, hook_secs=2.4) == pytest.approx(0.1 / 16)


def test_a_straggler_is_named_at_most_once_per_window_and_one_process_is_none(caplog):
    stragglers = Stragglers(window_steps=100)
    with caplog.at_level("WARNING", logger="jaxmon"):
        for step in range(10, 300, 10):
            stragglers.agreed(step, [0.004, 0.004, 0.020])
        stragglers.agreed(400, [0.004])  # one process: no one to compare with
        stragglers.agreed(410, [0.004, float("nan")])  # a process's time not known yet
    steps = [int(r.getMessage().rsplit("up to step ", 1)[1].split(";")[0]) for r in caplog.records]
    assert steps == [30, 130, 230]
    assert stragglers.host_per_step == (0.004, 0.004, 0.020)  # the last agreement with every process known


def test_the_host_time_per_step_is_unknown_before_an_agreement_and_at_its_step(monkeypatch):
    from jaxmon._processes import stragglers as module

    clock = [50.0]
    monkeypatch.setattr(module.time, "monotonic", lambda: clock[0])
    stragglers = Stragglers()
    assert math.isnan(stragglers.measure(10))
    stragglers.agreed(10, [math.nan, math.nan])
    assert math.isnan(stragglers.measure(10))
    clock[0] += 0.2
    assert stragglers.measure(20) == pytest.approx(0.02)
