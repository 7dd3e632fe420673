"""Metrics over steps on their own: the one int32 array the accumulators travel in
(`_Layout`), the reductions `Mean` and `FirstNonFinite` (update and result called on
plain values, no session), and `Accumulators`' reads (who restarts, when `after_read`
comes). Carries are packed by hand on the host; only the restart is jitted."""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxmon as jm
from jaxmon._metrics.accumulators import Accumulators, Declared, _Layout
from jaxmon._metrics.reductions import FirstNonFinite, Mean, Reduction, check_reduce

SCALAR = jax.ShapeDtypeStruct((), jnp.float32)


# -- the layout --------------------------------------------------------------------------------


def trees():
    return [np.array(7, np.int32),
            {"mean": np.array([1.5, -2.25], np.float32), "n": np.array(3, np.int32)},
            {"bad": np.array([np.nan, np.inf, -np.inf], np.float32), "m": np.eye(2, dtype=np.int32)}]


def layout():
    return _Layout(trees())


def assert_trees_equal(got, want):
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        a = np.asarray(a)
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(a, b)  # NaNs equal where both are NaN


def test_the_layout_packs_every_leaf_into_one_int32_array_and_back_on_the_host():
    packed = layout().pack_host(trees())
    assert packed.dtype == np.int32 and packed.shape == (1 + 3 + 3 + 4,) and layout().size == 11
    assert packed[0] == 7 and packed[1] == np.float32(1.5).view(np.int32)  # a float32 as its bits
    assert_trees_equal(layout().unpack_host(packed), trees())


def test_the_layout_packs_alike_when_traced():
    lay = layout()
    packed = lay.pack_host(trees())
    round_trip = jax.jit(lambda carry: lay.pack(lay.unpack(carry), into=carry))
    np.testing.assert_array_equal(np.asarray(round_trip(jnp.asarray(packed))), packed)
    traced = jax.jit(lambda: lay.pack(trees(), into=jnp.full(lay.size, -1, jnp.int32)))()  # every slot written
    np.testing.assert_array_equal(np.asarray(traced), packed)  # the traced pack gives the host's bits
    np.testing.assert_array_equal(np.asarray(traced), packed)
    assert_trees_equal(lay.unpack(jnp.asarray(packed)), trees())


def test_the_layout_takes_int32_and_float32_leaves_only():
    with pytest.raises(TypeError, match="accumulator leaves must be int32 or float32; got float64"):
        _Layout([np.zeros(2)])
    assert _Layout([]).pack_host([]).shape == (0,)


def test_the_restart_mask_covers_exactly_the_slots_of_the_trees_named():
    mask = layout().restart_mask([1])
    assert mask.tolist() == [False, True, True, True] + [False] * 7
    assert layout().restart_mask([0, 2]).tolist() == [True] + [False] * 3 + [True] * 7


# -- reductions ---------------------------------------------------------------------------------


def test_mean_is_the_mean_of_every_step_leaf_by_leaf():
    mean = Mean()
    value = {"a": SCALAR, "b": jax.ShapeDtypeStruct((2,), jnp.int32)}
    acc = mean.init({"value": value, "weight": SCALAR})
    assert acc["total"]["a"].dtype == np.float32 and acc["total"]["b"].shape == (2,)
    for i, x in enumerate([1.0, 2.0, 6.0]):
        acc = mean.update(acc, {"value": {"a": jnp.float32(x), "b": jnp.array([i, 2 * i])}, "weight": 1.0},
                          jnp.int32(i + 1))
    result = mean.result(jax.device_get(acc), 3)
    assert float(result["a"]) == 3.0 and result["b"].tolist() == [1.0, 2.0]
    assert np.isnan(mean.result(mean.init({"value": {"a": SCALAR}, "weight": SCALAR}), 0)["a"])  # no steps yet
    assert Mean.restarts and not FirstNonFinite.restarts


def run_first_non_finite(reduction, values, shape=()):
    acc = reduction.init(jax.ShapeDtypeStruct(shape, jnp.float32))
    accepted = []
    for step, value in enumerate(values, start=1):
        acc = reduction.update(acc, jnp.asarray(value, jnp.float32), jnp.int32(step))
        keep = reduction.accept(acc)
        accepted.append(None if keep is None else bool(keep))
    return reduction.result(jax.device_get(acc), len(values)), accepted


def test_first_non_finite_gives_the_first_bad_step_and_its_value():
    result, accepted = run_first_non_finite(FirstNonFinite(), [1.0, 2.0, np.nan, np.inf, 3.0])
    assert result["step"] == 3 and np.isnan(result["value"]) and result["skipped"] == 0
    assert accepted == [None] * 5  # no skips: every update is kept
    result, _ = run_first_non_finite(FirstNonFinite(), [1.0, -np.inf])
    assert result == {"step": 2, "value": -np.inf, "skipped": 0}
    result, _ = run_first_non_finite(FirstNonFinite(), [1.0, 2.0])
    assert result == {"step": None, "value": 0.0, "skipped": 0}


def test_first_non_finite_skips_up_to_max_skips_consecutive_bad_steps():
    values = [1.0, np.nan, np.nan, 1.0, np.nan, np.nan, np.nan, 1.0]
    result, accepted = run_first_non_finite(FirstNonFinite(max_skips=2), values)
    assert result["step"] == 7 and result["skipped"] == 4  # the third bad step in a row fails
    assert accepted == [True, False, False, True, False, False, True, True]  # after the failure: kept


def test_first_non_finite_of_an_array_counts_its_bad_entries():
    result, _ = run_first_non_finite(FirstNonFinite(), [np.ones(4), [1.0, np.nan, np.inf, 2.0]], shape=(4,))
    assert result == {"step": 2, "value": "2 of 4 entries non-finite", "skipped": 0}


def test_a_reduction_reads_its_value_by_name_path_list_or_callable():
    outputs = {"loss": jnp.float32(1.0), "vec": jnp.ones(3), "m": {"acc": jnp.float32(0.5)}}
    assert float(Reduction("m/acc").value(None, None, outputs)) == 0.5
    assert sorted(Reduction().value(None, None, outputs)) == ["loss", "m/acc"]  # every scalar output
    assert sorted(Reduction(["loss", "vec", "gone"]).value(None, None, outputs)) == ["loss"]
    assert Reduction(lambda s, b, o: s + 1).value(2, None, outputs) == 3
    with pytest.raises(ValueError, match=r"Reduction\('los'\) reduces 'los', which is not an output"
                                         r".*\['loss', 'm/acc', 'vec'\]"):
        Reduction("los").value(None, None, outputs)
    with pytest.raises(TypeError, match="Mean fetch: fetch"):
        Mean(["loss", 3])


def test_reduce_is_mean_or_last():
    assert check_reduce("Hook", "last") == "last"
    with pytest.raises(ValueError, match="Hook reduce must be 'mean'.*got 'sum'"):
        check_reduce("Hook", "sum")


# -- accumulators ---------------------------------------------------------------------------------


class Reads(jm.Hook):
    def __init__(self, name, **accumulators):
        self.name, self.accumulators = name, accumulators

    def after_read(self, step, values):
        pass  # told of every read (`Read.after_reads`)

    def __repr__(self):
        return f"Reads({self.name!r})"


def step_fn(state, batch):
    return state + 1, {"loss": state}


class Setup:
    """Accumulators of hooks a (a mean) and b (a mean and a first non-finite), prepared
    at step 0 without a compile; `carry(...)` puts a carry of the given sums in place."""

    def __init__(self):
        self.a = Reads("a", m=Mean("loss"))
        self.b = Reads("b", m=Mean("loss"), nan=FirstNonFinite("loss"))
        self.delivered = []
        self.acc = Accumulators([self.a, jm.Hook(), self.b])
        self.acc.start(0)
        self.acc.prepare(step_fn, jnp.float32(0), {}, program_steps=1, step=0, sharding=None)

    def deliver(self, read):
        """What the hook runner does with a read: its `after_read`s, unless delivered already."""
        values = read.after_reads()
        if values:
            self.delivered.append((read.step, [(hook.name, hook_values) for hook, hook_values in values]))

    def put(self, step, a, b, nan_step=-1):
        """A carry at `step` whose means' sums are `a` and `b` (their weights: the windows' steps)."""
        host = self.acc._layout.pack_host([np.array(step, np.int32), {"total": np.float32(a)},
                                           {"total": np.float32(b)},
                                           {"step": np.int32(nan_step), "value": np.float32(np.nan),
                                            "run": np.int32(0), "skipped": np.int32(1)}])
        self.acc.carry = jnp.asarray(host)  # as a run returns it

    def sums(self):
        _, a, b, nan = self.acc._layout.unpack_host(np.asarray(self.acc.carry))
        return float(a["total"]), float(b["total"]), int(nan["step"])


def test_a_steps_update_writes_the_carry_without_a_concatenate():
    """XLA's CPU backend does not fuse a concatenate of many parts (one per leaf): the carry
    is written as a chain of updates, which it fuses (benchmarks/RESULTS.md, step_pair.py)."""
    setup = Setup()
    carry = jnp.zeros(setup.acc._layout.size, jnp.int32)
    jaxpr = jax.make_jaxpr(lambda carry: setup.acc.update(carry, jnp.float32(1), jnp.float32(2), {},
                                                          {"loss": jnp.float32(1)}))(carry)
    primitives = {equation.primitive.name for equation in jaxpr.jaxpr.eqns}
    assert "concatenate" not in primitives and "dynamic_update_slice" in primitives, primitives
    new_carry, _ = setup.acc.update(carry, jnp.float32(1), jnp.float32(2), {}, {"loss": jnp.float32(1)})
    assert setup.acc._layout.unpack_host(np.asarray(new_carry))[0] == 1  # the step, then each leaf at its place


def test_only_hooks_with_reductions_take_part_and_they_must_be_reductions():
    setup = Setup()
    assert setup.acc.active and setup.acc._hooks == [setup.a, setup.b]
    assert not Accumulators([jm.Hook()]).active
    with pytest.raises(TypeError, match=r"Reads\('x'\).accumulators\['m'\] is 'loss', not a jm.Reduction"):
        Accumulators([Reads("x", m="loss")])


def test_a_read_restarts_only_the_readers_restarting_accumulators():
    setup = Setup()
    setup.put(5, a=10.0, b=20.0, nan_step=3)
    assert setup.acc.read(5, []) is None  # no reader
    read = setup.acc.read(5, [setup.b])
    assert setup.sums() == (10.0, 0.0, 3)  # b's mean restarted; a's and the sticky flag kept
    assert read.values(setup.b) == {"m": 4.0, "nan": {"step": 3, "value": pytest.approx(np.nan, nan_ok=True),
                                                      "skipped": 1}}
    assert read.values(setup.a) == {"m": 2.0}  # a's mean so far, over 5 steps, not restarted
    setup.put(8, a=16.0, b=6.0, nan_step=3)
    read = setup.acc.read(8, [setup.a, setup.b])
    assert read.values(setup.a)["m"] == 2.0 and read.values(setup.b)["m"] == 2.0  # 16 / 8 and 6 / (8 - 5)
    assert setup.sums() == (0.0, 0.0, 3)
    assert setup.acc.compile_count == 2  # one restart program per set of readers


def test_after_read_comes_once_per_read_with_every_hooks_values():
    setup = Setup()
    setup.put(4, a=4.0, b=8.0)
    read = setup.acc.read(4, [setup.a])
    assert read.host_carry is None  # read on the host when first needed
    assert read.values(setup.a) == {"m": 1.0} and read.host_carry is not None
    assert setup.delivered == []  # a read's values are no delivery: the hook runner delivers
    setup.deliver(read)
    assert setup.delivered == [(4, [("a", {"m": 1.0}), ("b", {"m": 2.0, "nan": {"step": None,
                                                                              "value": pytest.approx(np.nan,
                                                                                                     nan_ok=True),
                                                                              "skipped": 1}})])]
    assert setup.acc.read_now(4) is read  # the read of this step, delivered already
    setup.deliver(read)
    assert len(setup.delivered) == 1
    setup.put(6, a=2.0, b=8.0)
    setup.deliver(setup.acc.read_now(6))  # no read at 6: a new one, restarting nobody
    assert [step for step, _ in setup.delivered] == [4, 6]
    assert dict(setup.delivered[1][1])["a"]["m"] == 1.0 and setup.sums()[:2] == (2.0, 8.0)
    setup.deliver(setup.acc.read_now(6))
    assert len(setup.delivered) == 2


def test_only_hooks_with_an_after_read_are_told_and_the_others_values_wait_until_asked():
    class Quiet(jm.Hook):  # reads its mean in after_run (as the reporting hooks do), no after_read
        accumulators = {"m": Mean("loss")}

    told, quiet = Reads("told", m=Mean("loss")), Quiet()
    acc = Accumulators([quiet, told])
    acc.start(0)
    acc.prepare(step_fn, jnp.float32(0), {}, program_steps=1, step=0, sharding=None)
    means = [{"total": np.float32(total)} for total in (6, 2)]  # over the 4 steps since 0
    acc.carry = jnp.asarray(acc._layout.pack_host([np.array(4, np.int32), *means]))  # as a run returns it
    read = acc.read(4, [quiet, told])
    assert read.after_reads() == [(told, {"m": 0.5})]
    assert read.values(quiet) == {"m": 1.5} and read.values(told) == {"m": 0.5}
    assert read.after_reads() == []  # once


def test_read_now_gives_the_read_of_that_step_without_reading_again():
    setup = Setup()
    setup.put(3, a=3.0, b=3.0)
    read = setup.acc.read(3, [setup.b])
    assert setup.acc.read_now(3) is read and read.host_carry is not None
    setup.deliver(read)
    assert [step for step, _ in setup.delivered] == [3]
    assert setup.sums()[1] == 0.0  # read_now did not read (nor restart) again


def test_start_forgets_the_carry_and_counts_from_the_new_step():
    setup = Setup()
    setup.put(4, a=4.0, b=4.0)
    setup.acc.start(10)
    assert setup.acc.read(12, [setup.a]) is None
    assert setup.acc.read_now(12) is None


def test_update_keeps_the_old_state_while_a_skipping_reduction_refuses_it():
    hook = Reads("skip", nan=FirstNonFinite("loss", max_skips=1))
    acc = Accumulators([hook])
    acc.start(0)
    carry = acc.prepare(step_fn, jnp.float32(0), {}, program_steps=1, step=0, sharding=None)
    assert acc.guards
    new_carry, kept = acc.update(carry, jnp.float32(1.0), jnp.float32(2.0), {}, {"loss": jnp.float32(np.nan)})
    assert float(kept) == 1.0  # the first bad step is skipped: the old state stays
    _, nan = acc._layout.unpack_host(np.asarray(new_carry))
    assert int(nan["skipped"]) == 1 and int(acc._layout.unpack_host(np.asarray(new_carry))[0]) == 1
    _, kept = acc.update(new_carry, jnp.float32(1.0), jnp.float32(2.0), {}, {"loss": jnp.float32(np.nan)})
    assert float(kept) == 2.0  # the second in a row fails: kept, and reported


def test_a_saved_carry_of_another_layout_starts_the_windows_afresh_with_a_warning(caplog):
    """The same reductions, saved by a jaxmon that kept other fields for them (a `Mean`
    without a weight once carried one): the windows start afresh, and the log says so."""
    hook = Reads("a", m=Mean("loss"))
    acc = Accumulators([hook])
    acc.start(7, saved={"entries": acc._signature(), "carry": [7, 0, 0], "since": [3]})
    with caplog.at_level(logging.WARNING, logger="jaxmon"):
        acc.prepare(step_fn, jnp.float32(0), {}, program_steps=1, step=7, sharding=None)
    assert [r.getMessage() for r in caplog.records] == [
        "The checkpoint's windows have 3 fields where these reductions keep 2; the hooks' windows start afresh "
        "at step 7."]
    assert acc._layout.unpack_host(np.asarray(acc.carry))[1] == {"total": 0.0}
    acc.carry = jnp.asarray(acc._layout.pack_host([np.array(9, np.int32), {"total": np.float32(4)}]))
    assert acc.read(9, [hook]).values(hook) == {"m": 2.0}  # over the 2 steps since 7, not the 6 since 3


def test_a_process_that_declares_the_chiefs_hooks_restores_their_windows_quietly(caplog):
    """Hooks that run on the chief only are declared on the other processes (`Declared`):
    their windows in a checkpoint (the chief's) match there too; no warning on a resume."""
    chief = [Reads("bar", m=Mean("loss")), Reads("summaries", outputs=Mean("loss"))]
    user = Reads("user", u=Mean("loss"))
    on_chief = Accumulators([*chief, user])
    elsewhere = Accumulators([*(Declared(hook) for hook in chief), user])
    assert elsewhere._signature() == on_chief._signature()
    on_chief.start(0)
    on_chief.prepare(step_fn, jnp.float32(0), {}, program_steps=1, step=0, sharding=None)
    on_chief.carry = jnp.asarray(on_chief._layout.pack_host([np.array(4, np.int32), *(
        {"total": np.float32(total)} for total in (1, 2, 8))]))
    saved = on_chief.get_state(4)
    with caplog.at_level(logging.WARNING, logger="jaxmon"):
        elsewhere.start(4, saved)
        elsewhere.prepare(step_fn, jnp.float32(0), {}, program_steps=1, step=4, sharding=None)
    assert caplog.records == []
    assert elsewhere.read(6, [user]).values(user) == {"u": pytest.approx(8 / 6)}  # restored: its sum, since 0
