"""GoodputHook on its own: its arguments, the breakdown it writes as summaries and into
goodput.json, what the next process of a run takes from that file, the totals a
checkpoint keeps, and the lost time taken from the step categories. (A whole run killed
and resumed: tests/end_to_end/test_goodput.py.)"""

import json

import pytest
from helpers import RecordingWriter, count_step, zero

import jaxmon as jm
from jaxmon._ops import report_thread
from jaxmon._ops.time_spent import CATEGORIES
from jaxmon.hooks._goodput import _moved_to_lost

TAGS = [f"goodput/{category}" for category in CATEGORIES]


def run_steps(hook, steps, **session_kwargs):
    """A session of `hook` run `steps` times and closed; returns it."""
    with jm.MonitoredSession(count_step, zero, hooks=[hook], **session_kwargs) as sess:
        for _ in range(steps):
            sess.run()
    report_thread.wait()
    return sess


@pytest.mark.parametrize("kwargs, error, words", [
    ({}, ValueError, "needs somewhere to write"),
    ({"summary_writer": RecordingWriter(), "record_every_secs": -1}, ValueError, "record_every_secs"),
    ({"summary_writer": RecordingWriter(), "on_error": "shrug"}, ValueError, "shrug"),
    ({"summary_writer": RecordingWriter(), "every_n_steps": 0}, ValueError, "every_n_steps"),
], ids=["no-writer", "negative-record-secs", "unknown-policy", "zero-steps"])
def test_goodput_hook_checks_its_arguments(kwargs, error, words):
    with pytest.raises(error, match=words):
        jm.GoodputHook(**kwargs)


def test_the_breakdown_is_written_every_n_steps_and_at_close_with_every_category():
    writer = RecordingWriter()
    run_steps(jm.GoodputHook(summary_writer=writer, every_n_steps=2), 5)
    steps = writer.steps("goodput/goodput")
    assert steps[-1] == 5 and {2, 4} <= set(steps)
    for _, scalars in writer.scalars:
        assert set(scalars) == {*TAGS, "goodput/goodput"}
        assert all(scalars[tag] >= 0 for tag in TAGS)
        assert scalars["goodput/lost"] == 0 and scalars["goodput/idle"] == 0  # one process, no restart
        wall = sum(scalars[tag] for tag in TAGS)
        assert scalars["goodput/goodput"] == pytest.approx(scalars["goodput/productive"] / wall)


def test_goodput_json_records_the_process_and_the_next_process_counts_it_as_before(tmp_path):
    run_steps(jm.GoodputHook(output_dir=tmp_path, every_n_steps=100), 3)
    record = json.loads((tmp_path / "goodput.json").read_text())
    assert record["processes"] == 1 and record["before"] == dict.fromkeys(CATEGORIES, 0.0)
    process = record["process"]
    assert (process["first_step"], process["last_step"], process["steps_run"]) == (0, 3, 3)
    assert set(process["spent"]) == set(CATEGORIES)

    second = jm.GoodputHook(output_dir=tmp_path, every_n_steps=100)
    run_steps(second, 2, initial_step=3)  # a second process of the run, from no checkpoint
    record = json.loads((tmp_path / "goodput.json").read_text())
    assert record["processes"] == 2
    assert (record["process"]["first_step"], record["process"]["last_step"]) == (3, 5)
    earlier, before = process["spent"], record["before"]
    steps_time = ("productive", "data", "hooks")  # the first process's 3 steps: no checkpoint kept them, all lost
    assert before["lost"] == pytest.approx(earlier["lost"] + sum(earlier[k] for k in steps_time))
    assert all(before[k] == pytest.approx(0.0, abs=1e-12) for k in steps_time)
    for category in set(CATEGORIES) - {*steps_time, "lost", "idle"}:
        assert before[category] == pytest.approx(earlier[category])
    assert before["idle"] >= earlier["idle"]  # plus the time between the first's last record and the second's start
    assert second.totals()["lost"] >= before["lost"] > 0


def test_an_unreadable_goodput_json_is_a_warning_and_the_earlier_time_is_not_counted(tmp_path, caplog):
    (tmp_path / "goodput.json").write_text("[1, 2]")
    hook = jm.GoodputHook(output_dir=tmp_path, every_n_steps=100)
    run_steps(hook, 1)
    assert any("goodput.json is unreadable" in r.getMessage() for r in caplog.records)
    assert json.loads((tmp_path / "goodput.json").read_text())["processes"] == 1


def test_the_checkpointed_totals_are_the_totals_before_a_session():
    hook = jm.GoodputHook(summary_writer=RecordingWriter())
    run_steps(hook, 2)
    state = hook.get_state()
    assert set(state["goodput"]) == set(CATEGORIES)
    assert state["goodput"]["productive"] > 0

    restored = jm.GoodputHook(summary_writer=RecordingWriter())
    restored.set_state(state)
    assert restored.totals() == state["goodput"]
    assert restored.spent() == dict.fromkeys(CATEGORIES, 0.0)  # no session of its own yet


def test_lost_time_comes_from_the_step_categories_in_proportion_and_at_most_all_of_them():
    spent = {**dict.fromkeys(CATEGORIES, 0.0), "productive": 6.0, "data": 3.0, "hooks": 1.0, "compile": 5.0}
    moved = _moved_to_lost(spent, 2.0)
    assert moved["lost"] == pytest.approx(2.0)
    assert (moved["productive"], moved["data"], moved["hooks"]) == pytest.approx((4.8, 2.4, 0.8))
    assert moved["compile"] == 5.0  # not a step's time: never lost
    assert sum(moved.values()) == pytest.approx(sum(spent.values()))
    everything = _moved_to_lost(spent, 100.0)
    assert everything["lost"] == pytest.approx(10.0) and everything["productive"] == 0.0
    assert _moved_to_lost(spent, 0.0) == spent


def test_the_record_is_rewritten_at_most_every_record_every_secs(tmp_path):
    hook = jm.GoodputHook(output_dir=tmp_path, every_n_steps=1, record_every_secs=3600)
    with jm.MonitoredSession(count_step, zero, hooks=[hook]) as sess:
        for _ in range(4):
            sess.run()
            report_thread.wait()
            assert json.loads((tmp_path / "goodput.json").read_text())["process"]["last_step"] == 1
    report_thread.wait()
    assert json.loads((tmp_path / "goodput.json").read_text())["process"]["last_step"] == 4  # at close, always
