"""The hook protocol within one run: which hook gets which call, fetches and feeds, stop
requests, and the order of events across hooks."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import RecordingHook, count_step, events, zero

import jaxmon as jm


def test_hooks_that_ask_nothing_see_one_call_each_and_no_results():
    a, b = RecordingHook("a"), RecordingHook("b")
    sess = jm.MonitoredSession(count_step, zero, hooks=[a, b])
    before = list(a.log)
    batch = {"x": np.ones(2)}
    sess.run(batch, fetches=["value"])
    assert a.log[len(before):] == [("a", "before_run"), ("a", "after_run")]
    assert b.calls == {"begin": 1, "after_create_session": 1, "before_run": 1, "after_run": 1}
    assert a.values[0].results is None and b.values[0].results is None
    ctx = a.contexts[0]
    assert ctx.original_args.fetches == ["value"] and ctx.original_args.feeds is batch
    assert ctx.session is sess and ctx is b.contexts[0]
    assert (ctx.step, a.values[0].step) == (0, 1)


def test_the_context_carries_a_batch_that_is_not_a_dict():
    hook = RecordingHook()
    sess = jm.MonitoredSession(lambda s, b: (s, {"x": b[0]}), zero, hooks=[hook])
    batch = (np.ones(2), np.zeros(3))
    sess.run(batch)
    assert hook.contexts[0].original_args.feeds is batch


def test_hook_reprs_are_never_built_on_a_good_run():
    class Watched(jm.Hook):  # a repr that reads the device would be a hidden host sync
        reprs = 0

        def before_run(self, ctx):
            return jm.RunArgs(fetches=["value"]) if ctx.step == 0 else None

        def __repr__(self):
            Watched.reprs += 1
            return "Watched()"

    sess = jm.MonitoredSession(count_step, zero, hooks=[Watched()])
    for _ in range(3):
        sess.run()
    assert Watched.reprs == 0


def three_outputs(state, batch):
    return state, {"x": jnp.asarray(1.0), "y": jnp.asarray(2.0), "z": jnp.asarray(3.0)}


def test_each_requester_gets_exactly_its_own_fetches():
    a, b = RecordingHook("a", fetches=["x"]), RecordingHook("b", fetches={"why": "y"})
    sess = jm.MonitoredSession(three_outputs, zero, hooks=[a, b])
    assert sess.run(fetches=["z"]) == [3.0]  # a list asked gives a list, in its order
    assert a.values[0].results == [1.0]
    assert b.values[0].results == {"why": 2.0}
    assert isinstance(a.values[0].results[0], np.ndarray)


def add_inputs(state, batch):
    return state, {"sum": sum(batch.values())}


def test_feeds_from_hooks_alone_make_the_batch():
    hooks = [RecordingHook("a", feeds={"a": 5.0}), RecordingHook("b", feeds={"b": 10.0})]
    sess = jm.MonitoredSession(add_inputs, zero, hooks=hooks)
    total = sess.run(fetches="sum")  # a single name gives its value itself
    assert isinstance(total, np.ndarray) and total == 15.0


def test_feeds_merge_with_the_callers_batch_without_changing_it():
    hooks = [RecordingHook("a", feeds={"a": 5.0}), RecordingHook("b", feeds={"b": 10.0})]
    sess = jm.MonitoredSession(add_inputs, zero, hooks=hooks)
    batch = {"c": 20.0}
    total = sess.run(batch, fetches="sum")
    assert isinstance(total, np.ndarray) and total == 35.0
    assert batch == {"c": 20.0}


def test_the_same_key_fed_by_two_hooks_is_an_error():
    hooks = [RecordingHook("a", feeds={"a": 5.0}), RecordingHook("b", feeds={"a": 10.0})]
    sess = jm.MonitoredSession(add_inputs, zero, hooks=hooks)
    with pytest.raises(RuntimeError, match=r"Same batch key is fed by two hooks: 'a'"):
        sess.run()


def test_the_same_key_fed_by_a_hook_and_the_caller_is_an_error():
    sess = jm.MonitoredSession(add_inputs, zero, hooks=[RecordingHook("a", feeds={"a": 5.0})])
    with pytest.raises(RuntimeError, match=r"fed by a hook and the caller: \['a'\]"):
        sess.run({"a": 1.0})


def test_should_stop_turns_true_right_after_the_run_that_asked():
    sess = jm.MonitoredSession(count_step, zero, hooks=[RecordingHook(stop_at=3)])
    seen = []
    for _ in range(3):
        sess.run()
        seen.append(sess.should_stop())
    assert seen == [False, False, True]


def test_run_after_a_stop_is_an_error():
    sess = jm.MonitoredSession(count_step, zero, hooks=[RecordingHook(stop_at=1)])
    sess.run()
    with pytest.raises(RuntimeError, match="Run called even after should_stop requested"):
        sess.run()
    sess2 = jm.MonitoredSession(count_step, zero)
    sess2.request_stop()
    with pytest.raises(RuntimeError, match="should_stop"):
        sess2.run()


def test_without_hooks_the_step_gets_exactly_the_callers_batch():
    def echo(state, batch):
        x, (y, z) = batch
        return state, {"x": x, "y": y, "z": z}

    sess = jm.MonitoredSession(echo, zero)
    x, y = np.arange(6.0).reshape(2, 3), np.int32(7)
    out = sess.run((x, (y, np.float32(0.5))), fetches=["x", "y", "z"])
    assert isinstance(out, list) and len(out) == 3
    out_x, out_y, out_z = out
    np.testing.assert_array_equal(out_x, x)
    assert out_y == 7 and out_y.dtype == np.int32 and out_z == 0.5


def test_every_event_goes_to_hooks_in_list_order():
    log = []
    h1, h2 = RecordingHook("h1", log), RecordingHook("h2", log)
    with jm.MonitoredSession(count_step, zero, hooks=[h1, h2]) as sess:
        sess.run()
        sess.run()
    for event in ("begin", "after_create_session", "before_run", "after_run", "end"):
        names = events(log, event)
        assert names == ["h1", "h2"] * (len(names) // 2) and names, event
    order = [event for name, event in log if name == "h1"]
    assert order == ["begin", "after_create_session", "before_run", "after_run",
                     "before_run", "after_run", "end"]


def fails_on_flag(state, batch):
    if "fail" in batch:
        raise ValueError("step failed")
    return state + 1, {"value": state + 1}


@pytest.mark.parametrize("where", ["step", "before_run"])
def test_no_after_run_when_the_step_or_a_before_run_raises(where):
    boom = ValueError("before_run failed")
    first = RecordingHook("first")
    second = RecordingHook("second", raise_in={"before_run": (2, boom)} if where == "before_run" else None)
    sess = jm.MonitoredSession(fails_on_flag, zero, hooks=[first, second])
    sess.run({"x": 1.0})
    with pytest.raises(ValueError, match="failed"):
        sess.run({"x": 1.0, "fail": 1.0} if where == "step" else {"x": 1.0})
    assert first.calls["before_run"] == 2 and first.calls["after_run"] == 1
    assert second.calls["after_run"] == 1
    assert sess.step == 1 and not sess.should_stop()  # an error does not stop


def test_a_stop_request_does_not_skip_later_hooks_after_run():
    h1, h2 = RecordingHook("h1", stop_at=1), RecordingHook("h2")
    sess = jm.MonitoredSession(count_step, zero, hooks=[h1, h2])
    sess.run()
    assert h2.calls["after_run"] == 1 and h2.contexts[0].stop_requested
    assert sess.should_stop()


def test_callable_fetches_see_the_post_step_state_the_batch_and_outputs():
    def spy(state, batch, outputs):
        return {"state": state, "batch": batch["x"], "value": outputs["value"] * 10}

    sess = jm.MonitoredSession(lambda s, b: count_step(s, b), zero)
    got = sess.run({"x": jnp.asarray(4.0)}, fetches={"spy": spy})["spy"]
    assert (got["state"], got["batch"], got["value"]) == (1, 4.0, 10)
    assert jax.tree.map(type, got) == {"state": np.ndarray, "batch": np.ndarray, "value": np.ndarray}
