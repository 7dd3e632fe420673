"""The compiled step: fetch-set cache, async dispatch, donation, and errors at the door."""

import logging
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import RecordingHook, count_step, dispatch_secs, slow_matmuls, zero

import jaxmon as jm


def traced_step():
    traces = []

    def step_fn(state, batch):
        traces.append(1)
        state = state + batch["x"]
        return state, {"value": state, "double": 2 * state, "x": batch["x"]}

    return step_fn, traces


def norm(state, batch, outputs):
    return jnp.abs(state)


class Alternating(jm.Hook):
    def before_run(self, ctx):
        return jm.RunArgs(fetches=["value"] if ctx.step % 2 else {"n": norm, "d": "double"})


def test_alternating_fetch_sets_compile_once_per_set():
    step_fn, traces = traced_step()
    sess = jm.MonitoredSession(step_fn, lambda: jnp.zeros(()), hooks=[Alternating()])
    for _ in range(20):
        sess.run({"x": np.float32(1.0)})
    # two programs, one trace of the user's step: both variants inline the same trace
    assert len(traces) == 1 and sess.compile_count == 2 and sess.step == 20


def test_equal_fetch_sets_share_a_variant_whoever_asks_and_in_any_order():
    step_fn, traces = traced_step()
    sess = jm.MonitoredSession(step_fn, lambda: jnp.zeros(()), hooks=[RecordingHook(fetches=["x"])])
    sess.run({"x": np.float32(1.0)}, fetches=["value", "double"])
    sess.run({"x": np.float32(1.0)}, fetches={"d": "double", "v": "value"})
    out = sess.run({"x": np.float32(1.0)}, fetches=["double", "x", "value"])
    assert len(traces) == 1 and out == [6.0, 1.0, 3.0]  # a list asked: a list, in its order


def test_a_new_callable_every_run_warns(caplog):
    step_fn, _ = traced_step()
    sess = jm.MonitoredSession(step_fn, lambda: jnp.zeros(()))
    with caplog.at_level(logging.WARNING, logger="jaxmon"):
        for _ in range(10):
            sess.run({"x": np.float32(1.0)}, fetches={"n": lambda s, b, o: s})
    assert sess.compile_count == 10
    assert "same object every run" in caplog.text


SIZE, COUNT = slow_matmuls()  # by backend: a step slower than dispatching five runs


def slow_step(state, batch):
    x = jax.lax.fori_loop(0, COUNT, lambda i, x: jnp.tanh(x @ x), state)
    return x, {"loss": x[0, 0]}


def test_runs_without_fetches_never_wait_for_the_device():
    sess = jm.MonitoredSession(slow_step, lambda: jnp.eye(SIZE) * 0.5)
    sess.run(fetches=["loss"])  # compile both variants before timing
    sess.run()
    one_step = []
    for _ in range(3):
        start = time.perf_counter()
        sess.run(fetches=["loss"])  # waits for the result
        one_step.append(time.perf_counter() - start)
    dispatch_five = dispatch_secs(sess, below=min(one_step))
    assert dispatch_five < min(one_step), (dispatch_five, one_step)
    assert isinstance(sess.run()["loss"], jax.Array)
    assert sess.compile_count == 1  # output names are read from the outputs: no variant


def test_the_state_is_donated_by_default_and_kept_when_asked():
    donated = jm.MonitoredSession(count_step, zero)
    before = donated.state
    donated.run()
    assert before.is_deleted() and int(donated.state) == 1

    kept = jm.MonitoredSession(count_step, zero, donate_state=False)
    before = kept.state
    kept.run()
    assert not before.is_deleted() and int(before) == 0 and int(kept.state) == 1


# -- errors at the door ---------------------------------------------------------------

def test_a_step_fn_with_the_wrong_arity_is_rejected_at_construction():
    with pytest.raises(TypeError, match=r"two positional arguments \(state, batch\); .*\(state\)"):
        jm.MonitoredSession(lambda state: (state, {}), zero)
    with pytest.raises(TypeError, match="must be a function"):
        jm.MonitoredSession("not a function", zero)


@pytest.mark.parametrize("result, message", [
    ((0, [1.0]), r"outputs must be a dict of arrays .* it returned a list of 1: \(float\)"),
    ((0, [jnp.ones(3)]), r"it returned a list of 1: \(float32\[3\]\)"),
    ((0, {"loss": "low"}), r"these entries are not arrays: \{'loss': \"a str \('low'\)\"\}"),
    ((0, {"nested": {"a": "low"}}), r"not arrays: \{'nested/a':"),  # a nested bad entry, named by its path
    (0, r"must return a pair \(new_state, outputs\); it returned an int"),
    ((0, {}, 1), r"it returned a tuple of 3"),
])
def test_bad_step_outputs_are_named_on_the_first_run(result, message):
    def step_fn(state, batch):
        return (state + result[0], *result[1:]) if isinstance(result, tuple) else result

    sess = jm.MonitoredSession(step_fn, zero)
    with pytest.raises(TypeError, match=message):
        sess.run()


def test_a_new_state_of_another_shape_or_structure_is_rejected():
    sess = jm.MonitoredSession(lambda s, b: ({"w": s["w"], "extra": 1.0}, {}), lambda: {"w": jnp.ones(2)})
    with pytest.raises(TypeError, match="another structure"):
        sess.run()
    sess = jm.MonitoredSession(lambda s, b: ({"w": jnp.ones(3)}, {}), lambda: {"w": jnp.ones(2)})
    with pytest.raises(TypeError, match=r"state\['w'\] from \(\(2,\), dtype\('float32'\)\)"):
        sess.run()


def test_hooks_must_be_hooks():
    with pytest.raises(TypeError, match=r"hooks\[1\] is 'oops' of type str, not a jaxmon Hook"):
        jm.MonitoredSession(count_step, zero, hooks=[RecordingHook(), "oops"])
    with pytest.raises(TypeError, match=r"Pass hooks=\[hook\]"):
        jm.MonitoredSession(count_step, zero, hooks=RecordingHook())


def test_a_fetch_name_not_in_the_outputs_lists_the_outputs():
    sess = jm.MonitoredSession(count_step, zero, hooks=[RecordingHook("h", fetches=["accuracy"])])
    with pytest.raises(ValueError, match=r"RecordingHook\('h'\) fetches 'accuracy'.* outputs are \['value'\]"):
        sess.run()
    sess = jm.MonitoredSession(count_step, zero)
    with pytest.raises(ValueError, match=r"run\(fetches=...\) fetches 'loss'"):
        sess.run(fetches="loss")


def test_bad_fetches_and_run_args_are_named():
    sess = jm.MonitoredSession(count_step, zero)
    value = sess.run(fetches=norm)  # a single callable gives its value itself
    assert isinstance(value, np.ndarray) and float(value) == float(sess.fetch({"n": norm})["n"]) == 1.0
    with pytest.raises(TypeError, match="fetch 'n' is 3"):
        sess.run(fetches={"n": 3})

    class Bad(jm.Hook):
        def before_run(self, ctx):
            return ["value"]

    with pytest.raises(TypeError, match=r"before_run returned \['value'\]; return jm.RunArgs"):
        jm.MonitoredSession(count_step, zero, hooks=[Bad()]).run()


def test_an_unhashable_callable_fetch_is_named():
    class Scaled:
        def __eq__(self, other):
            return False

        def __call__(self, state, batch, outputs):
            return state

    with pytest.raises(TypeError, match="fetch 'f' is an unhashable callable \\(Scaled\\)"):
        jm.MonitoredSession(count_step, zero).run(fetches={"f": Scaled()})


def test_a_hook_feeding_a_key_the_data_already_has_is_named():
    sess = jm.MonitoredSession(lambda s, b: (s, {}), zero, data=[{"x": 1.0}],
                               hooks=[RecordingHook("h", feeds={"x": 2.0})])
    with pytest.raises(RuntimeError, match=r"\['x'\] is already in the batch \(given to run\(\) or taken from data\)"):
        sess.run()


def test_init_arguments_are_validated():
    with pytest.raises(ValueError, match="exactly one of init_fn= .* or state="):
        jm.MonitoredSession(count_step)
    with pytest.raises(ValueError, match="exactly one of"):
        jm.MonitoredSession(count_step, zero, state=zero())
    with pytest.raises(ValueError, match="max_recoveries must be an int >= 0; got -1"):
        jm.MonitoredSession(count_step, zero, max_recoveries=-1)
    with pytest.raises(TypeError, match="got a value of type ArrayImpl. To pass the state itself, use state="):
        jm.MonitoredSession(count_step, jnp.zeros(()))
    with pytest.raises(ValueError, match="stop_grace_period_secs must be a number >= 0; got '1'"):
        jm.MonitoredSession(count_step, zero, stop_grace_period_secs="1")


def test_a_batch_whose_shape_changes_warns_with_the_step_the_key_and_both_shapes(caplog):
    def step_fn(state, batch):
        return state + batch["x"].sum(), {"loss": state}

    data = [{"x": np.ones((4, 2), np.float32), "y": np.zeros(4, np.int32)}] * 5
    data.append({"x": np.ones((3, 2), np.float32), "y": np.zeros(3, np.int32)})  # a ragged last batch
    with caplog.at_level("WARNING", logger="jaxmon"):
        with jm.MonitoredSession(step_fn, state=jnp.zeros(()), data=data) as sess:
            while not sess.should_stop():
                sess.run()
    assert sess.step == 6 and float(sess.state) == 5 * 8 + 6 and sess.compile_count == 2
    [warning] = [r.getMessage() for r in caplog.records if "other shapes" in r.getMessage()]
    assert warning.startswith("The batch of step 6 has other shapes than the first batch: "
                              "batch['x'] float32[3,2] (was float32[4,2]); batch['y'] int32[3] (was int32[4]).")
    assert "compiles again" in warning and "pad the last one" in warning
