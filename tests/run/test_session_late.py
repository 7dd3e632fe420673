"""Late delivery (RunArgs(late=True)), sess.sync(), sess.fetch(), and Hook.close on every exit."""

from __future__ import annotations

import logging

import jax
import numpy as np
import pytest
from helpers import RecordingHook, count_step, events, zero

import jaxmon as jm


class LateHook(RecordingHook):
    def before_run(self, ctx):
        super().before_run(ctx)
        return jm.RunArgs(fetches=["value"], late=True)


def test_a_late_after_run_comes_after_the_next_dispatch_with_its_own_run():
    log = []
    late, now = LateHook("late", log), RecordingHook("now", log)
    sess = jm.MonitoredSession(count_step, zero, hooks=[late, now])
    sess.run()
    assert events(log, "after_run") == ["now"]  # the late one waits for the next run
    sess.run()
    ordered = [entry for entry in log if entry[1] in ("before_run", "after_run")]
    assert ordered == [("late", "before_run"), ("now", "before_run"), ("now", "after_run"),
                       ("late", "before_run"), ("now", "before_run"), ("late", "after_run"), ("now", "after_run")]
    assert [v.step for v in late.values] == [1] and late.values[0].results == [1]
    assert isinstance(late.values[0].results, list) and isinstance(late.values[0].results[0], np.ndarray)
    assert isinstance(late.values[0].outputs["value"], jax.Array)


def test_sync_and_close_deliver_what_is_pending_before_end():
    log = []
    late = LateHook("late", log)
    sess = jm.MonitoredSession(count_step, zero, hooks=[late])
    sess.run()
    sess.sync()
    assert [v.step for v in late.values] == [1]
    sess.run()
    sess.close()
    assert [v.step for v in late.values] == [1, 2]
    assert log[-2:] == [("late", "after_run"), ("late", "end")]


def test_a_stop_requested_late_stops_after_the_next_run():
    class StopLate(jm.Hook):
        def before_run(self, ctx):
            return jm.RunArgs(late=True)

        def after_run(self, ctx, values):
            if values.step == 3:
                ctx.request_stop()

    with jm.MonitoredSession(count_step, zero, hooks=[StopLate()]) as sess:
        while not sess.should_stop():
            sess.run()
    assert sess.step == 4


def test_an_error_exit_still_delivers_the_last_good_run():
    def failing_step(state, batch):
        return state + 1, {"value": state + 1, "bad": 1 / batch["n"]}

    late = LateHook()
    with pytest.raises(ZeroDivisionError):
        with jm.MonitoredSession(failing_step, zero, hooks=[late]) as sess:
            sess.run({"n": np.float32(1)})
            raise ZeroDivisionError("in the loop")
    assert [v.step for v in late.values] == [1] and "end" not in late.calls


def test_output_names_never_compile_and_outputs_reach_every_hook():
    hooks = [RecordingHook(fetches=["value"]), LateHook()]
    sess = jm.MonitoredSession(count_step, zero, hooks=hooks)
    for _ in range(5):
        sess.run(fetches="value")
    sess.sync()
    assert sess.compile_count == 1
    assert [v.results for v in hooks[0].values] == [[1], [2], [3], [4], [5]]  # a list asked: a list
    assert [v.results for v in hooks[1].values] == [[1], [2], [3], [4], [5]]


def test_fetch_evaluates_on_the_last_run_without_a_step():
    def total(state, batch, outputs):
        return state * 10 + batch["x"]

    sess = jm.MonitoredSession(lambda s, b: (s + b["x"], {"value": s + b["x"]}), zero)
    assert sess.fetch({"zero": lambda s, b, o: s}) == {"zero": 0}
    sess.run({"x": np.int32(2)})
    sess.run({"x": np.int32(3)})
    assert sess.fetch({"t": total, "v": "value"}) == {"t": 53, "v": 5}
    assert sess.fetch({"t": total})["t"] == 53 and sess.step == 2 and sess.compile_count == 1
    with pytest.raises(ValueError, match="not an output"):
        sess.fetch("nope")


class Closing(RecordingHook):
    def close(self):
        self._event("close")


def test_close_runs_on_every_exit_and_its_errors_never_hide_the_first():
    log = []
    hooks = [Closing("a", log, raise_in={"close": (1, OSError("disk full"))}), Closing("b", log)]
    with pytest.raises(KeyError):
        with jm.MonitoredSession(count_step, zero, hooks=hooks):
            raise KeyError("the real error")
    assert events(log, "close") == ["a", "b"] and not events(log, "end")

    log.clear()
    hooks = [Closing("a", log, raise_in={"close": (1, OSError("disk full"))}), Closing("b", log)]
    with pytest.raises(OSError, match="disk full") as info:
        with jm.MonitoredSession(count_step, zero, hooks=hooks):
            pass
    assert events(log, "close") == ["a", "b"] and events(log, "end") == ["a", "b"]
    assert any("RecordingHook('a').close" in note for note in info.value.__notes__)


def test_a_warn_hook_that_fails_to_close_does_not_fail_a_good_run(caplog):
    hook = Closing("a", raise_in={"close": (1, OSError("disk full"))})
    hook.on_error = "warn"
    with caplog.at_level(logging.ERROR, logger="jaxmon"):
        with jm.MonitoredSession(count_step, zero, hooks=[hook]) as sess:
            sess.run()
    assert "disk full" in caplog.text
