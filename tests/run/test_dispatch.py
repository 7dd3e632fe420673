"""One run's dispatch on its own: a `RunPlan` in, a `RunResult` out, with a tiny real
step (a scalar state plus the batch's "x"). Plans are built by hand, as the hook runner
makes them; the hooks are never called here."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxmon as jm
from jaxmon._base.fetches import normalize
from jaxmon._run.dispatch import Dispatch
from jaxmon._run.hook_runner import QUIET, Call, RunPlan, RunResult


def step(state, batch):
    return state + batch["x"], {"loss": state, "nested": {"twice": 2 * state}}


def doubled(state, batch, outputs):
    return 2 * state


def fed(state, batch, outputs):
    return batch["y"]


class Named(jm.Hook):
    def __init__(self, name):
        self.name = name

    def __repr__(self):
        return f"Named({self.name!r})"


A, B, C = Named("a"), Named("b"), Named("c")
BATCH = {"x": np.float32(1.0)}


def plan(*calls, feeds=()):
    """A plan of `(hook, fetches)` calls and `(hook, feeds)` feeds."""
    return RunPlan.of(None, tuple(Call(hook, False, normalize(fetches, hook), False) for hook, fetches in calls),
                      tuple(feeds))


def new_dispatch(**kwargs):
    return Dispatch(step, donate_state=False, placement=None, max_dispatch_ahead=kwargs.pop("ahead", None), **kwargs)


def zero():
    return jnp.zeros((), jnp.float32)


@pytest.fixture(scope="module")
def dispatch():
    """One dispatch for the module's tests that do not count compiles."""
    return new_dispatch()


def test_a_quiet_plan_fetches_nothing_and_returns_the_new_state_and_outputs(dispatch):
    result = dispatch(zero(), BATCH, QUIET, wanted=None, steps=1, step=0)
    assert isinstance(result, RunResult)
    assert float(result.state) == 1.0 and float(result.outputs["loss"]) == 0.0
    assert result.caller is None and result.results == ()
    result = dispatch(result.state, BATCH, QUIET, wanted=None, steps=1, step=1)
    assert float(result.state) == 2.0 and float(result.outputs["nested"]["twice"]) == 2.0
    assert dispatch.last_outputs is result.outputs


def test_each_calls_values_line_up_with_the_plans_calls_and_the_callers_come_apart(dispatch):
    state = jnp.float32(3.0)
    run_plan = plan((A, "loss"), (B, None), (C, {"d": doubled, "t": "nested/twice"}))
    result = dispatch(state, BATCH, run_plan, wanted=normalize(["loss", doubled], "run(fetches=...)"), steps=1, step=0)
    assert len(result.results) == len(run_plan.calls)
    loss, nothing, named = result.results
    assert float(loss) == 3.0 and nothing is None
    assert {k: float(v) for k, v in named.items()} == {"d": 8.0, "t": 6.0}  # doubled sees the new state, 4
    assert [float(v) for v in result.caller] == [3.0, 8.0]
    assert isinstance(loss, jax.Array)  # on the device: the runner reads them on the host


def test_the_same_calls_again_get_the_same_values_and_a_bad_name_raises_on_its_run(dispatch):
    run_plan = plan((A, "loss"), (B, None), (C, {"d": doubled, "t": "nested/twice"}))
    for _ in range(2):  # the plan's own fetch plan, made once with it
        result = dispatch(jnp.float32(3.0), BATCH, run_plan, wanted=None, steps=1, step=0)
        assert isinstance(result.results, tuple) and len(result.results) == 3
        loss, nothing, named = result.results
        assert float(loss) == 3.0 and nothing is None
        assert {k: float(v) for k, v in named.items()} == {"d": 8.0, "t": 6.0}
    assert run_plan.fetch_plan(None) is run_plan.fetches
    with pytest.raises(ValueError, match="fetches 'nope', which is not an output"):
        dispatch(jnp.float32(3.0), BATCH, plan((A, "nope")), wanted=None, steps=1, step=0)


def test_a_plan_whose_calls_fetch_nothing_has_no_results_but_the_caller_still_gets_its(dispatch):
    result = dispatch(jnp.float32(1.0), BATCH, plan((A, None), (B, None)), wanted=normalize("loss", "run"), steps=1,
                      step=0)
    assert result.results == () and float(result.caller) == 1.0


def test_feeds_are_merged_into_the_batch(dispatch):
    run_plan = plan((A, fed), feeds=[(B, {"y": np.float32(5.0)})])
    result = dispatch(zero(), BATCH, run_plan, wanted=None, steps=1, step=0)
    assert float(result.results[0]) == 5.0 and float(result.state) == 1.0
    hook_batch = plan((A, fed), feeds=[(B, {"y": np.float32(5.0)}), (C, {"x": np.float32(2.0)})])
    # no batch of the caller: the hooks' feeds make it
    result = dispatch(zero(), None, hook_batch, wanted=None, steps=1, step=0)
    assert float(result.state) == 2.0 and float(result.results[0]) == 5.0


def test_a_key_fed_twice_is_an_error_naming_the_key_and_the_feeders(dispatch):
    twice = plan(feeds=[(A, {"y": 1.0}), (B, {"y": 2.0})])
    with pytest.raises(RuntimeError, match=r"'y' by Named\('a'\) and Named\('b'\)"):
        dispatch(zero(), BATCH, twice, wanted=None, steps=1, step=0)
    with pytest.raises(RuntimeError, match=r"\['x'\] is already in the batch.*fed by Named\('c'\)"):
        dispatch(zero(), BATCH, plan(feeds=[(C, {"x": 1.0})]), wanted=None, steps=1, step=0)
    with pytest.raises(TypeError, match="the batch is a tuple"):
        dispatch(zero(), (1.0,), plan(feeds=[(C, {"x": 1.0})]), wanted=None, steps=1, step=0)


def test_fetching_output_names_never_compiles_and_a_new_callable_compiles_once():
    dispatch = new_dispatch()
    state = dispatch(zero(), BATCH, QUIET, wanted=None, steps=1, step=0).state
    assert dispatch.compile_count == 1
    for i, fetches in enumerate(["loss", ["loss", "nested/twice"], {"l": "loss"}]):
        state = dispatch(state, BATCH, plan((A, fetches)), wanted=normalize("nested", "run"), steps=1, step=i).state
    assert dispatch.compile_count == 1
    for i in range(3):
        state = dispatch(state, BATCH, plan((A, doubled), (B, "loss")), wanted=None, steps=1, step=i).state
    assert dispatch.compile_count == 2
    both = plan((A, [doubled]), (B, {"d": doubled}))  # the same callable for two requesters: one program
    dispatch(state, BATCH, both, wanted=normalize(doubled, "run"), steps=1, step=3)
    assert dispatch.compile_count == 2


def test_fetch_evaluates_on_the_state_and_the_last_runs_batch_and_outputs():
    dispatch = new_dispatch()
    assert dispatch.fetch(zero(), None) == {}
    result = dispatch(jnp.float32(2.0), BATCH, QUIET, wanted=None, steps=1, step=0)
    values = dispatch.fetch(result.state, {"d": doubled, "x": lambda s, b, o: b["x"], "loss": "loss"})
    assert values == {"d": 6.0, "x": 1.0, "loss": 2.0}
    assert all(isinstance(v, np.ndarray) for v in values.values())
    assert dispatch.fetch(result.state, "nested/twice") == 4.0
    assert dispatch.compile_count == 1  # fetch never compiles the step


def test_max_dispatch_ahead_must_be_a_positive_int_or_none_or_auto():
    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(ValueError, match=f"max_dispatch_ahead must be an int >= 1; got {bad!r}"):
            new_dispatch(ahead=bad)
    assert new_dispatch(ahead=None).max_dispatch_ahead is None
    assert new_dispatch(ahead=3).max_dispatch_ahead == 3
    assert new_dispatch(ahead="auto").max_dispatch_ahead is None  # one device: no bound


def test_max_dispatch_ahead_keeps_at_most_that_many_runs_in_flight():
    dispatch = new_dispatch(ahead=2)
    state = zero()
    for i in range(5):
        state = dispatch(state, BATCH, QUIET, wanted=None, steps=1, step=i).state
        assert len(dispatch._in_flight) == min(i + 1, 2)
    assert float(state) == 5.0


def test_a_multi_step_run_gets_each_feed_at_every_step_and_fetch_sees_its_last_batch():
    dispatch = new_dispatch(steps_per_dispatch=2)
    stacked = {"x": np.array([1.0, 2.0], np.float32)}

    def total_y(state, batch, outputs):
        return batch["y"]

    result = dispatch(zero(), stacked, plan((A, total_y), feeds=[(B, {"y": np.float32(5.0)})]), wanted=None,
                      steps=2, step=0)
    assert float(result.state) == 3.0 and float(result.results[0]) == 5.0  # the last step's batch
    assert float(result.outputs["loss"]) == 1.0  # the last step's outputs
    assert float(dispatch.fetch(result.state, lambda s, b, o: b["x"])) == 2.0
