"""scan_unroll: how far the `lax.scan` of a run of several steps is unrolled.

"auto" unrolls fully where XLA runs the step slowly in a loop (a convolution on CPU)
and keeps a loop elsewhere; every choice trains to the state of one step per run.
"""

from __future__ import annotations

import threading

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import programs_for
from jax.extend import core

import jaxmon as jm
import jaxmon._run.compiled_step
from jaxmon._experiment.sections import session_args_of
from jaxmon._run.scan_unroll import Scan, canonical_convolutions, convolves, platform_of, resolve_scan_unroll

STEPS = 6
TX = optax.adam(0.05)


def mlp_init():
    k1, k2 = jax.random.split(jax.random.key(0))
    params = {"w1": jax.random.normal(k1, (4, 8)) * 0.5, "w2": jax.random.normal(k2, (8, 1)) * 0.5}
    return {"params": params, "opt": TX.init(params)}


def mlp_step(state, batch):
    def loss_fn(params):
        return jnp.mean((jnp.tanh(batch["x"] @ params["w1"]) @ params["w2"] - batch["y"]) ** 2)

    loss, grads = jax.value_and_grad(loss_fn)(state["params"])
    updates, opt = TX.update(grads, state["opt"], state["params"])
    return {"params": optax.apply_updates(state["params"], updates), "opt": opt}, {"loss": loss}


def conv_step(state, batch):
    def loss_fn(kernel):
        y = jax.lax.conv_general_dilated(batch["x"], kernel, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
        return jnp.mean(y ** 2)

    loss, grad = jax.value_and_grad(loss_fn)(state)
    return state - 0.1 * grad, {"loss": loss}


KERNEL = jax.ShapeDtypeStruct((3, 3, 1, 2), jnp.float32)
IMAGES = jax.ShapeDtypeStruct((2, 4, 4, 1), jnp.float32)
CANONICAL = ((0, 3, 1, 2), (3, 2, 0, 1), (0, 3, 1, 2))  # the dimension numbers of NHWC, HWIO -> NHWC


def conv_init():
    return jnp.ones((3, 3, 1, 2)) * 0.1


def conv_batches():
    return [{"x": np.random.default_rng(i).normal(size=(2, 4, 4, 1)).astype(np.float32)} for i in range(6)]


def mlp_batches():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(STEPS, 8, 4)).astype(np.float32)
    return [{"x": x[i], "y": np.sin(x[i]).sum(axis=1, keepdims=True)} for i in range(STEPS)]


class Lengths(jm.Hook):
    def __init__(self):
        self.lengths = []

    def after_run(self, ctx, values):
        self.lengths.append(ctx.steps)


def train(step_fn, init_fn, batches, k, scan_unroll="auto"):
    """Every batch, `k` steps per run at most; the final state on the host and the run lengths."""
    runs = Lengths()
    with jm.MonitoredSession(step_fn, init_fn, data=batches, steps_per_dispatch=k, scan_unroll=scan_unroll,
                             hooks=[jm.StopAtStepHook(last_step=len(batches)), runs]) as sess:
        while not sess.should_stop():
            sess.run()
        assert sess.compile_count == programs_for(runs.lengths, scan_unroll)
    assert sess.step == len(batches)
    return jax.tree.map(np.asarray, sess.state)


@pytest.fixture(scope="module")
def one_step_per_run():
    return train(mlp_step, mlp_init, mlp_batches(), 1)


# -- "auto" -------------------------------------------------------------------------------------


def test_auto_is_a_loop_everywhere_with_the_convolutions_rewritten_on_cpu():
    assert resolve_scan_unroll("auto", "cpu", convolution=True) == Scan(1, canonical=True)
    assert resolve_scan_unroll("auto", "cpu", convolution=False) == Scan(1, canonical=False)  # an MLP: a plain loop
    for platform in ("gpu", "tpu"):  # XLA runs loops well there
        assert resolve_scan_unroll("auto", platform, convolution=True) == Scan(1, canonical=False)
        assert resolve_scan_unroll("auto", platform, convolution=False) == Scan(1, canonical=False)
    for chosen in (1, 4, True):  # a choice is taken as given, on every platform
        assert resolve_scan_unroll(chosen, "cpu", convolution=True) == Scan(chosen, canonical=False)
        assert resolve_scan_unroll(chosen, "gpu", convolution=False).unroll is chosen


def test_the_platform_is_the_state_devices_and_convolutions_are_found_in_the_gradient():
    assert platform_of({"w": jnp.ones(2)}) == jax.devices()[0].platform
    assert platform_of({"w": np.ones(2), "n": 3}) == jax.default_backend()
    assert convolves(conv_step, KERNEL, {"x": IMAGES})
    assert convolves(jax.checkpoint(conv_step), KERNEL, {"x": IMAGES})  # inside a remat
    assert not convolves(mlp_step, jax.eval_shape(mlp_init), mlp_batches()[0])


def nested_step(kernel, batch):
    """Convolutions at the top level, in a jit, a remat, a custom_vjp and a loop, with their gradients."""
    def loss_fn(kernel):
        x = batch["x"]
        y = conv(x, kernel) + jax.jit(conv)(x, kernel) + jax.checkpoint(conv)(x, kernel) + custom_conv(x, kernel)
        z = jax.lax.fori_loop(0, 2, lambda i, z: z + conv(x, kernel), jnp.zeros_like(y))
        return jnp.mean(jax.nn.relu(y) ** 2) + jnp.mean(z)

    loss, grad = jax.value_and_grad(loss_fn)(kernel)
    return kernel - 0.1 * grad, {"loss": loss}


def conv(x, kernel):
    return jax.lax.conv_general_dilated(x, kernel, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))


@jax.custom_vjp
def custom_conv(x, kernel):
    return conv(x, kernel)


custom_conv.defvjp(lambda x, kernel: (conv(x, kernel), (x, kernel)),
                   lambda saved, g: (jnp.zeros_like(saved[0]), jax.grad(lambda k: jnp.vdot(conv(saved[0], k), g))(
                       saved[1])))


def convolutions(jaxpr):
    """The dimension numbers of every convolution of `jaxpr` outside loops and branches,
    calls included."""
    found = []
    for equation in jaxpr.eqns:
        if equation.primitive.name == "conv_general_dilated":
            found.append(tuple(map(tuple, equation.params["dimension_numbers"])))
        elif equation.primitive.name not in ("while", "cond", "scan"):
            for inner in core.jaxprs_in_params(equation.params):
                found += convolutions(inner)
    return found


def test_the_rewrite_gives_every_convolution_the_cpu_kernel_layout_and_the_same_numbers_bit_for_bit():
    kernel = jax.random.normal(jax.random.key(1), (3, 3, 1, 2))
    batch = {"x": jax.random.normal(jax.random.key(2), (2, 5, 5, 1))}
    before = convolutions(jax.make_jaxpr(nested_step)(kernel, batch).jaxpr)
    after = convolutions(jax.make_jaxpr(canonical_convolutions(nested_step))(kernel, batch).jaxpr)
    assert len(before) == len(after) >= 9 and set(before) != {CANONICAL}  # the gradients' are not
    assert set(after) == {CANONICAL}
    want = jax.jit(nested_step)(kernel, batch)
    got = jax.jit(canonical_convolutions(nested_step))(kernel, batch)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(a, b)


def test_the_scan_gets_the_unroll_and_the_step_of_each_choice(monkeypatch):
    seen = []
    scan = jax.lax.scan

    def recording_scan(body, init, xs, *, length=None, unroll=1, **kwargs):
        found = convolutions(jax.make_jaxpr(body)(init, jax.tree.map(lambda x: x[0], xs)).jaxpr)
        seen.append((length, unroll, found and set(found) == {CANONICAL}))  # every convolution canonical
        return scan(body, init, xs, length=length, unroll=unroll, **kwargs)

    def recording_loop(lower, upper, body, init, **kwargs):
        found = convolutions(jax.make_jaxpr(body)(0, init).jaxpr)
        seen.append(("loop", found and set(found) == {CANONICAL}))
        return fori_loop(lower, upper, body, init, **kwargs)

    fori_loop = jax.lax.fori_loop
    monkeypatch.setattr(jax.lax, "scan", recording_scan)
    monkeypatch.setattr(jax.lax, "fori_loop", recording_loop)
    train(conv_step, conv_init, conv_batches(), 4)
    if jax.default_backend() == "cpu":
        assert seen == [("loop", True)]  # one loop for runs of 4, 2 and 1 steps, its convolutions rewritten
    else:  # GPU and TPU: a scan for each length, the convolutions as made
        assert sorted(seen) == [(2, 1, False), (4, 1, False)]
    seen.clear()
    train(conv_step, conv_init, conv_batches(), 4, scan_unroll=1)
    assert sorted(seen) == [(2, 1, False), (4, 1, False)]  # a scan for each length, the convolutions as made
    seen.clear()
    train(conv_step, conv_init, conv_batches(), 4, scan_unroll=True)
    assert sorted(seen) == [(2, True, False), (4, True, False)]  # the gradient's convolution as JAX made it
    seen.clear()
    train(mlp_step, mlp_init, mlp_batches()[:4], 4, scan_unroll=3)
    assert sorted(seen) == [(4, 3, [])]  # no convolution; one run of 4: no program of 2 steps


# -- every choice trains alike ----------------------------------------------------------------


@pytest.mark.parametrize("scan_unroll", ["auto", 1, 2, 3, True])
def test_every_choice_gives_the_state_of_one_step_per_run(one_step_per_run, scan_unroll):
    state = train(mlp_step, mlp_init, mlp_batches(), 4, scan_unroll)  # runs of 4 and 2 steps
    for got, want in zip(jax.tree.leaves(state), jax.tree.leaves(one_step_per_run), strict=True):
        if scan_unroll == "auto" or type(scan_unroll) is int and scan_unroll == 1:  # a loop: bit for bit
            np.testing.assert_array_equal(got, want)
        else:  # unrolled, XLA may fuse across steps and round a reduction differently
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert not np.allclose(state["params"]["w1"], mlp_init()["params"]["w1"])  # it trained


def test_a_convolution_on_cpu_trains_as_one_step_per_run_bit_for_bit():
    one = train(conv_step, conv_init, conv_batches(), 1)
    np.testing.assert_array_equal(train(conv_step, conv_init, conv_batches(), 4), one)  # "auto": rewritten
    np.testing.assert_allclose(train(conv_step, conv_init, conv_batches(), 4, True), one, rtol=1e-5, atol=1e-6)
    assert not np.allclose(one, 0.1)  # it trained


# -- bad values ----------------------------------------------------------------------------------


@pytest.mark.parametrize(("value", "error"), [(0, ValueError), (-2, ValueError), (False, ValueError),
                                              ("full", ValueError), ("AUTO", ValueError), (2.0, TypeError),
                                              (None, TypeError)])
def test_a_bad_value_is_refused_naming_it_and_the_choices(value, error):
    with pytest.raises(error, match="scan_unroll must be") as raised:
        jm.MonitoredSession(mlp_step, mlp_init, scan_unroll=value)
    assert repr(value) in str(raised.value)
    assert '"auto", True (fully unrolled) or an int >= 1 (1: a loop)' in str(raised.value)


def test_the_training_session_and_an_experiment_config_take_it(tmp_path):
    assert session_args_of({"session": {"scan_unroll": 1, "steps_per_dispatch": 8}}) == {
        "scan_unroll": 1, "steps_per_dispatch": 8}
    with pytest.raises(ValueError, match="got 'loop'"):
        jm.MonitoredTrainingSession(step_fn=mlp_step, init_fn=mlp_init, checkpoint_dir=str(tmp_path),
                                    scan_unroll="loop")


# -- a run whose program is still compiling ------------------------------------------------------


class EndsAtStepOne(jm.Hook):
    """Ends the first run at step 1 (compiling the one-step program first) and records
    every run as the hooks see it."""

    def __init__(self):
        self.lengths = []

    def after_run(self, ctx, values):
        self.lengths.append(ctx.steps)

    def next_trigger(self, step):
        return jm.Trigger(step=1) if step < 1 else None


def test_a_run_whose_program_compiles_in_the_background_runs_step_by_step_meanwhile(monkeypatch):
    released, compiled = threading.Event(), []
    compile_ahead = jaxmon._run.compiled_step._compile

    def held_compile(variant, args, length, todo, started):
        assert released.wait(timeout=60)
        compile_ahead(variant, args, length, todo, started)
        compiled.append(length)

    monkeypatch.setattr(jaxmon._run.compiled_step, "_compile", held_compile)
    batches, hook = mlp_batches() + mlp_batches()[:3], EndsAtStepOne()
    reference = train(mlp_step, mlp_init, batches, 1)
    with jm.MonitoredSession(mlp_step, mlp_init, data=batches, hooks=[hook], steps_per_dispatch=4,
                             scan_unroll=1) as sess:  # one program per run length, as on GPU and TPU
        sess.run()
        sess.run()  # 4 steps, with the programs of 4 and 2 steps held back: one by one
        assert sess.step == 5 and compiled == []
        released.set()
        assert sess.compile_count == 2  # 1, then 4 in the background: only the lengths run, none twice
        assert compiled == [4]
        sess.run()  # with its own program
    assert hook.lengths == [1, 4, 4] and sess.step == 9
    for got, want in zip(jax.tree.leaves(jax.tree.map(np.asarray, sess.state)), jax.tree.leaves(reference),
                         strict=True):
        np.testing.assert_array_equal(got, want)


def test_the_first_run_of_a_program_compiled_in_the_background_counts_as_compile_time():
    """Its first call waits for what is left of its compilation and traces it again on the
    loop's thread: goodput counts that as compile time, and the runs after it as training."""
    with jm.MonitoredSession(mlp_step, mlp_init, data=mlp_batches() * 2, hooks=[EndsAtStepOne()],
                             steps_per_dispatch=4, scan_unroll=1) as sess:  # one program per run length
        sess.run()
        sess.run()  # 4 steps one by one, while their program compiles in the background
        sess._dispatch._compiled.wait_ahead()
        before = sess.time_spent.secs["compile"]
        sess.run()  # the 4-step program's first call
        first = sess.time_spent.secs["compile"]
        sess.run()
        assert first > before and sess.time_spent.secs["compile"] == first
