"""The contract every built-in hook keeps: lifecycle in a real session, argument checks, zero steps."""

from __future__ import annotations

import io
import json

import jax.numpy as jnp
import numpy as np
import pytest

import jaxmon as jm


def step_fn(state, batch):
    state = state + batch["x"]
    return state, {"loss": state.sum(), "acc": state / 10}


def eval_fn(state, batch):
    return {"loss": (state * batch["x"]).mean()}


def batches(n):
    return [{"x": np.full((2,), 1.0, np.float32)} for _ in range(n)]


def init_fn():
    return jnp.zeros((2,), jnp.float32)


# name -> (a valid hook from a tmp directory, [(bad keyword arguments, expected error)])
CASES = {
    "StopAtStepHook": (lambda d: jm.StopAtStepHook(num_steps=100), [
        ({}, ValueError), ({"num_steps": 1, "last_step": 1}, ValueError), ({"num_steps": -1}, ValueError)]),
    "LoggingHook": (lambda d: jm.LoggingHook(["loss"], every_n_iter=2, at_end=True), [
        ({"fetches": ["loss"]}, ValueError), ({"fetches": ["loss"], "every_n_iter": 0}, ValueError),
        ({"fetches": ["loss"], "every_n_iter": 1, "every_n_secs": 1}, ValueError),
        ({"fetches": 3, "every_n_iter": 1}, TypeError),
        ({"fetches": ["loss"], "every_n_iter": 1, "on_error": "ignore"}, ValueError)]),
    "StepCounterHook": (lambda d: jm.StepCounterHook(every_n_steps=2, output_dir=d), [
        ({"every_n_steps": None}, ValueError), ({"every_n_secs": 1}, ValueError),
        ({"every_n_steps": 0}, ValueError), ({"batch_size": 0}, ValueError),
        ({"output_dir": "x", "summary_writer": jm.MultiWriter([])}, ValueError),
        ({"summary_writer": object()}, TypeError)]),
    "SummarySaverHook": (lambda d: jm.SummarySaverHook(save_steps=2, output_dir=d, hparams={"lr": 0.1}), [
        ({"output_dir": "x"}, ValueError), ({"save_steps": 1}, ValueError),
        ({"save_steps": 1, "save_secs": 1, "output_dir": "x"}, ValueError),
        ({"save_steps": 1, "output_dir": "x", "summaries": ["loss"]}, TypeError),
        ({"save_steps": 1, "output_dir": "x", "summaries": {"a": 3}}, TypeError)]),
    "NanHook": (lambda d: jm.NanHook("loss"), [({"fetch": 3}, TypeError), ({"fetch": ["a", 1]}, TypeError)]),
    "FeedFnHook": (lambda d: jm.FeedFnHook(lambda: {"y": np.float32(1)}), [({"feed_fn": {"y": 1}}, TypeError)]),
    "FinalOpsHook": (lambda d: jm.FinalOpsHook({"total": lambda s, b, o: s.sum(), "loss": "loss"}), [
        ({"final_fetches": None}, ValueError), ({"final_fetches": 3}, TypeError)]),
    "GlobalStepWaiterHook": (lambda d: jm.GlobalStepWaiterHook(0), [
        ({"wait_until_step": 1.5}, ValueError), ({"wait_until_step": 1, "timeout_secs": -1}, ValueError),
        ({"wait_until_step": 1, "watch": 3}, TypeError)]),
    "GoodputHook": (lambda d: jm.GoodputHook(output_dir=d, every_n_steps=2), [
        ({}, ValueError), ({"output_dir": "x", "summary_writer": object()}, ValueError),
        ({"output_dir": "x", "every_n_steps": 1, "every_n_secs": 1}, ValueError)]),
    "ProfilerHook": (lambda d: jm.ProfilerHook(save_steps=3, output_dir=d), [
        ({"output_dir": "x"}, ValueError), ({"save_steps": 1}, ValueError),
        ({"save_steps": 1, "save_secs": 1, "output_dir": "x"}, ValueError)]),
    "EarlyStoppingHook": (lambda d: jm.EarlyStoppingHook("loss", patience=100, every_n_steps=2), [
        ({"fetch": "loss", "mode": "lowest"}, ValueError), ({"fetch": "loss", "patience": -1}, ValueError),
        ({"fetch": "loss", "min_delta": -1}, ValueError), ({"fetch": "loss", "source": object()}, TypeError)]),
    "EvalHook": (lambda d: jm.EvalHook(eval_fn, batches(2), every_n_steps=2, output_dir=d), [
        ({"eval_fn": 3, "data": []}, TypeError), ({"eval_fn": eval_fn, "data": iter([])}, ValueError),
        ({"eval_fn": eval_fn, "data": [], "at_end": False}, ValueError),
        ({"eval_fn": eval_fn, "data": [], "every_n_steps": 1, "every_n_secs": 1}, ValueError)]),
    "ProgressBarHook": (lambda d: jm.ProgressBarHook(enabled=True, stream=io.StringIO(), every_n_secs=0), [
        ({"total_steps": 0}, ValueError), ({"fetches": "loss"}, ValueError), ({"every_n_secs": -1}, ValueError)]),
    "CheckpointSaverHook": (lambda d: jm.CheckpointSaverHook(d, save_steps=2, max_to_keep=2), [
        ({"checkpoint_dir": "x"}, ValueError), ({"checkpoint_dir": "x", "save_steps": 1, "save_secs": 1}, ValueError),
        ({"checkpoint_dir": "", "save_steps": 1}, ValueError), ({"checkpoint_dir": 3, "save_steps": 1}, ValueError),
        ({"checkpoint_dir": "x", "save_steps": 1, "max_to_keep": 0}, ValueError),
        ({"checkpoint_dir": "x", "save_steps": 1, "keep_best": 2}, ValueError),
        ({"checkpoint_dir": "x", "save_steps": 1, "best_mode": "lowest"}, ValueError),
        ({"checkpoint_dir": "x", "save_steps": 1, "listeners": [object()]}, TypeError)]),
    "PeriodicHook": (lambda d: jm.PeriodicHook(lambda session: None, every_n_steps=2, at_end=True), [
        ({"fn": 3, "every_n_steps": 1}, TypeError), ({"fn": print}, ValueError),
        ({"fn": print, "every_n_steps": 1, "every_n_secs": 1}, ValueError)]),
}


def test_every_public_hook_is_in_the_contract():
    hooks = {name for name in jm.__all__
             if isinstance(getattr(jm, name), type) and issubclass(getattr(jm, name), jm.Hook)
             and getattr(jm, name) is not jm.Hook and getattr(jm, name).__name__ == name}
    assert hooks == set(CASES)


EVENTS = ("begin", "after_create_session", "before_run", "after_run", "end", "close")


def spy(hook):
    """Records the hook's events in order, calling through to the real methods."""
    calls = []
    for event in EVENTS:
        method = getattr(hook, event)

        def recorded(*args, _method=method, _event=event):
            calls.append(_event)
            return _method(*args)

        setattr(hook, event, recorded)
    return calls


@pytest.mark.parametrize("name", sorted(CASES))
def test_lifecycle_in_a_real_session(name, tmp_path):
    hook = CASES[name][0](str(tmp_path))
    calls = spy(hook)
    with jm.MonitoredSession(step_fn, init_fn, data=batches(5), hooks=[hook]) as sess:
        while not sess.should_stop():
            sess.run()
    assert sess.step == 5
    assert calls[:2] == ["begin", "after_create_session"] and calls[-2:] == ["end", "close"]
    assert calls.count("before_run") == 5 and calls.count("after_run") == 5
    assert calls.count("begin") == calls.count("end") == calls.count("close") == 1


@pytest.mark.parametrize("name", sorted(CASES))
def test_zero_steps_do_not_crash(name, tmp_path):
    hook = CASES[name][0](str(tmp_path))
    calls = spy(hook)
    with jm.MonitoredSession(step_fn, init_fn, data=batches(5), hooks=[jm.StopAtStepHook(last_step=0), hook]) as sess:
        assert sess.should_stop()
    assert sess.step == 0 and calls == ["begin", "after_create_session", "end", "close"]


@pytest.mark.parametrize("name", sorted(CASES))
def test_an_error_exit_skips_end_but_still_closes(name, tmp_path):
    hook = CASES[name][0](str(tmp_path))
    calls = spy(hook)
    with pytest.raises(ZeroDivisionError):
        with jm.MonitoredSession(step_fn, init_fn, data=batches(5), hooks=[hook]) as sess:
            sess.run()
            sess.run()
            raise ZeroDivisionError("in the loop")
    assert "end" not in calls and calls[-1] == "close" and calls.count("after_run") == 2


@pytest.mark.parametrize("name", sorted(CASES))
def test_bad_arguments_raise_errors_that_name_them(name):
    cls = getattr(jm, name)
    for kwargs, error in CASES[name][1]:
        with pytest.raises(error) as info:
            cls(**kwargs)
        assert str(info.value), (name, kwargs)


@pytest.mark.parametrize("name", sorted(CASES))
def test_own_state_survives_a_json_round_trip(name, tmp_path):
    hook = CASES[name][0](str(tmp_path / "a"))
    with jm.MonitoredSession(step_fn, init_fn, data=batches(3), hooks=[hook]) as sess:
        while not sess.should_stop():
            sess.run()
    state = hook.get_state()
    assert state is None or json.loads(json.dumps(state)) == state
    if name == "ProgressBarHook":  # a seconds timer: its state holds how long it had waited
        assert isinstance(state["timer"]["waited"], float) and state["timer"]["waited"] >= 0.0
    fresh = CASES[name][0](str(tmp_path / "b"))
    fresh.begin()
    if state is not None:
        fresh.set_state(json.loads(json.dumps(state)))
        # exactly, a seconds timer's "waited" too: it goes on counting only when a session starts
        assert fresh.get_state() == state
    fresh.close()
