"""One run's plan and result as immutable records: `RunPlan.of` derives who is called now,
a run late or on the report thread, who fetches and who reads, and the fetch plan with
the caller's slot first."""

import pytest

import jaxmon as jm
from jaxmon._base.fetches import normalize
from jaxmon._run.plan import CALLER, QUIET, Call, RunPlan, RunResult


def test_a_plan_is_an_immutable_tuple_of_calls():
    plan = RunPlan.of(None, (Call(jm.Hook()),))
    with pytest.raises(AttributeError):
        plan.calls = ()
    assert QUIET == RunPlan(None) and QUIET.calls == () and QUIET.feeds == ()


def loss(state, batch, outputs):
    return outputs["loss"]


def test_the_indices_say_who_is_called_now_a_run_late_on_the_report_thread_and_who_fetches():
    a, b, c, d = (jm.Hook() for _ in range(4))
    calls = (Call(a), Call(b, late=True, fetches=normalize("loss", b)), Call(c, late=True, away=True, read=True),
             Call(d, fetches=normalize([loss], d)))
    plan = RunPlan.of("ctx", calls, feeds=((a, {"x": 1}),), only_read=(b,), keeps=(c,))
    assert (plan.ctx, plan.calls, plan.feeds) == ("ctx", calls, ((a, {"x": 1}),))
    assert (plan.now, plan.late, plan.away, plan.fetching) == ((0, 3), (1,), (2,), (1, 3))
    assert plan.readers == (c, b) and plan.keeps == (c,)  # the calls that read, then those that only read


def test_the_fetch_plan_puts_the_callers_fetches_first_and_keeps_the_hooks_own():
    a, b = jm.Hook(), jm.Hook()
    plan = RunPlan.of(None, (Call(a, fetches=normalize({"l": "loss", "f": loss}, a)), Call(b)))
    assert plan.fetches.key == (loss,) and plan.fetches.owners == {"loss": a, loss: a}
    assert plan.fetch_plan(None) is plan.fetches  # the hooks' alone: made once
    wanted = normalize(["acc", loss], CALLER)
    both = plan.fetch_plan(wanted)
    assert both.owners == {"acc": CALLER, loss: CALLER, "loss": a}  # a value two ask for is the caller's
    caller, first = both.route({"loss": 1.5, "acc": 0.25}, [3.0])  # the caller's, then each fetching call's
    assert caller == [0.25, 3.0] and first == {"l": 1.5, "f": 3.0}


def test_equal_calls_are_equal_values_and_a_result_defaults_to_no_fetches():
    hook = jm.Hook()
    assert Call(hook, fetches=normalize("loss", hook)) == Call(hook, fetches=normalize("loss", hook))
    assert Call(hook) != Call(hook, late=True)
    assert RunPlan.of(None, [Call(hook)]).calls == (Call(hook),)  # a list of calls becomes a tuple
    result = RunResult("state", {"loss": 1.0})
    assert (result.caller, result.results) == (None, ())
