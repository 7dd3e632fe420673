"""Fetch requests on their own: `normalize` (the structure a requester gets its values
in), `FetchPlan` (one key per set of callables, and each requester's values routed
back) and `output` (an output by its name or path). No session, no compile: the
values are plain numbers standing for device arrays."""

from __future__ import annotations

import pytest

from jaxmon._base.fetches import FetchPlan, Wanted, normalize, output


def fn_a(state, batch, outputs):
    return "a"


def fn_b(state, batch, outputs):
    return "b"


def fn_c(state, batch, outputs):
    return "c"


OUTPUTS = {"loss": 1.0, "acc": 2.0, "grads": {"w": 3.0, "b": {"x": 4.0}}}


def test_nothing_asked_normalises_to_none_and_a_wanted_is_kept_as_it_is():
    assert normalize(None, "hook") is None
    wanted = normalize(["loss"], "hook")
    assert normalize(wanted, "other") is wanted


def test_a_name_or_a_callable_gives_its_value_alone():
    by_name = normalize("loss", "hook")
    assert isinstance(by_name, Wanted) and dict(by_name) == {"loss": "loss"}
    assert by_name.shaped({"loss": 1.0}) == 1.0
    by_fn = normalize(fn_a, "hook")
    assert dict(by_fn) == {"value": fn_a}
    assert by_fn.shaped({"value": "a"}) == "a"


def test_a_list_gives_a_list_in_its_order_with_callables_named_by_position():
    wanted = normalize(["acc", fn_a, "loss", fn_b], "hook")
    assert dict(wanted) == {"acc": "acc", "[1]": fn_a, "loss": "loss", "[3]": fn_b}
    assert wanted.shaped({"loss": 1.0, "acc": 2.0, "[1]": "a", "[3]": "b"}) == [2.0, "a", 1.0, "b"]
    assert normalize(("loss",), "hook").shaped({"loss": 1.0}) == [1.0]  # a tuple is a sequence too
    assert normalize(["loss", "loss"], "hook").shaped({"loss": 1.0}) == [1.0, 1.0]


def test_a_dict_gives_a_dict_by_its_result_names():
    wanted = normalize({"l": "loss", "f": fn_a}, "hook")
    assert wanted.shape is None and dict(wanted) == {"l": "loss", "f": fn_a}
    values = {"l": 1.0, "f": "a"}
    assert wanted.shaped(values) == values


def test_bad_specs_name_their_owner_and_the_fetch():
    with pytest.raises(TypeError, match=r"MyHook\(\): fetch 'n' is 3, which is neither an output name nor a callable"):
        normalize({"n": 3}, "MyHook()")
    with pytest.raises(TypeError, match=r"MyHook\(\): fetch '\[1\]' is 2.5"):
        normalize(["loss", 2.5], "MyHook()")
    with pytest.raises(TypeError, match=r"MyHook\(\): fetch result names must be str; got 1"):
        normalize({1: "loss"}, "MyHook()")
    with pytest.raises(TypeError, match=r"MyHook\(\): cannot fetch 7"):
        normalize(7, "MyHook()")


class Unhashable:
    __hash__ = None

    def __call__(self, state, batch, outputs):
        return 0


def test_an_unhashable_callable_names_its_owner_and_its_type():
    with pytest.raises(TypeError, match=r"run\(fetches=...\): fetch 'value' is an unhashable callable \(Unhashable\)"):
        normalize(Unhashable(), "run(fetches=...)")
    with pytest.raises(TypeError, match=r"fetch 'u' is an unhashable callable"):
        normalize({"u": Unhashable()}, "hook")


class Loud:
    """An owner whose repr must never be built on a good request."""

    def __repr__(self):
        raise AssertionError("the owner's repr was built")

    __str__ = __repr__


def test_a_good_request_never_formats_its_owner():
    normalize({"l": "loss", "f": fn_a}, Loud())
    plan = FetchPlan([(Loud(), normalize(["loss", "grads/w"], "x"))])
    assert plan.route(OUTPUTS, ()) == [[1.0, 3.0]]


def test_equal_callable_sets_give_equal_keys_whatever_the_order_and_owner():
    first = FetchPlan([("caller", normalize([fn_a, fn_b], "caller")), ("hook", normalize("loss", "hook"))])
    second = FetchPlan([("other", normalize({"x": fn_b}, "other")), ("more", normalize([fn_c], "more")),
                        ("last", normalize(fn_a, "last"))])
    third = FetchPlan([("one", normalize([fn_b, fn_a, fn_a], "one"))])
    assert set(first.key) == {fn_a, fn_b} and len(first.key) == 2
    assert third.key == first.key  # each callable once, in one order
    assert set(second.key) == {fn_a, fn_b, fn_c}
    assert FetchPlan([("x", normalize([fn_c, fn_b, fn_a], "x"))]).key == second.key


def test_output_names_never_enter_the_key():
    plan = FetchPlan([("caller", normalize(["loss", "grads/w"], "caller")), ("hook", normalize({"a": "acc"}, "h"))])
    assert plan.key == ()
    assert plan.owners == {"loss": "caller", "grads/w": "caller", "acc": "hook"}


class SameHash:
    """A callable whose hash every instance shares (equal only to itself)."""

    def __init__(self, name):
        self.name = name

    def __hash__(self):
        return 7

    def __call__(self, state, batch, outputs):
        return self.name


def test_equal_callable_sets_give_equal_keys_even_when_their_hashes_collide():
    """The key sorts callables by hash alone: two distinct callables with one hash keep
    the order they were asked in, so the same set asked the other way round would get
    another key (and another compiled variant)."""
    x, y = SameHash("x"), SameHash("y")
    assert FetchPlan([("h", normalize([x, y], "h"))]).key == FetchPlan([("h", normalize([y, x], "h"))]).key


def test_route_gives_each_requester_its_values_in_its_structure_and_none_to_those_that_asked_none():
    requests = [("caller", normalize("loss", "caller")), ("quiet", None),
                ("hook", normalize({"w": "grads/w", "f": fn_a}, "hook")), ("list", normalize([fn_b, "acc"], "list"))]
    plan = FetchPlan(requests)
    fetched = tuple({fn_a: "A", fn_b: "B"}[fn] for fn in plan.key)  # one value per callable of the key
    assert plan.route(OUTPUTS, fetched) == [1.0, None, {"w": 3.0, "f": "A"}, ["B", 2.0]]


def test_a_plan_nobody_asked_anything_of_routes_none_to_everyone():
    plan = FetchPlan([("caller", None), ("hook", None)])
    assert plan.key == () and plan.owners == {}
    assert plan.route(OUTPUTS, ()) == (None, None)


def test_a_nested_output_is_found_by_its_path_and_a_sub_dict_by_its_prefix():
    assert output(OUTPUTS, "loss", "hook") == 1.0
    assert output(OUTPUTS, "grads/b/x", "hook") == 4.0
    assert output(OUTPUTS, "grads/b", "hook") == {"x": 4.0}
    assert output({"a/b": 5.0, "a": {"b": 6.0}}, "a/b", "hook") == 5.0  # a key with a slash comes first


def test_a_missing_output_names_the_owner_and_lists_every_output_path():
    with pytest.raises(ValueError, match=r"LogHook\(\) fetches 'grads/z', which is not an output of the step "
                                         r"function; its outputs are \['acc', 'grads/b/x', 'grads/w', 'loss'\]"):
        output(OUTPUTS, "grads/z", "LogHook()")
    with pytest.raises(ValueError, match="fetches 'loss/x'"):  # a path through a leaf
        output(OUTPUTS, "loss/x", "hook")
    plan = FetchPlan([("caller", None), ("EvalHook()", normalize("missing", "x"))])
    with pytest.raises(ValueError, match=r"EvalHook\(\) fetches 'missing'"):
        plan.route(OUTPUTS, ())
