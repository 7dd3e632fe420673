"""TrainState with Flax linen and Flax NNX models, trained through MonitoredSession."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxmon as jm


def regression_data(seed=0, n=64):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 3)).astype(np.float32)
    y = x @ np.array([[1.5], [-2.0], [0.5]], np.float32) + 0.3
    return {"x": x, "y": y}


def losses_through_session(step_fn, init_fn, steps=60):
    batch = regression_data()
    with jm.MonitoredSession(step_fn, init_fn, hooks=[jm.StopAtStepHook(num_steps=steps)]) as sess:
        losses = []
        while not sess.should_stop():
            losses.append(float(sess.run(batch, fetches="loss")))
    return losses, sess


class Linear(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(1)(x)


def linen_step(state, batch):
    def loss_fn(params):
        return jnp.mean((state.apply_fn({"params": params}, batch["x"]) - batch["y"]) ** 2)

    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), {"loss": loss}


def test_a_linen_model_trains_below_a_fifth_of_its_first_loss():
    def init_fn():
        params = Linear().init(jax.random.PRNGKey(0), jnp.zeros((1, 3)))["params"]
        return jm.TrainState.create(apply_fn=Linear().apply, params=params, tx=optax.adam(0.1), rng=0)

    losses, sess = losses_through_session(linen_step, init_fn)
    assert losses[-1] < 0.2 * losses[0], losses[::10]
    assert int(sess.state.step) == sess.step == 60  # apply_gradients counts too
    assert sess.compile_count == 1


def nnx_step(state, batch):
    def loss_fn(params):
        return jnp.mean((state.nnx_model(params)(batch["x"]) - batch["y"]) ** 2)

    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), {"loss": loss}


def test_an_nnx_model_split_into_graphdef_and_state_trains_below_a_fifth():
    def init_fn():
        return jm.TrainState.from_nnx(nnx.Linear(3, 1, rngs=nnx.Rngs(0)), tx=optax.adam(0.1))

    losses, sess = losses_through_session(nnx_step, init_fn)
    assert losses[-1] < 0.2 * losses[0], losses[::10]
    model = sess.state.nnx_model()
    assert isinstance(model, nnx.Linear) and sess.compile_count == 1


class Noisy(nnx.Module):
    def __init__(self, rngs):
        self.dense = nnx.Linear(3, 8, rngs=rngs)
        self.norm = nnx.BatchNorm(8, rngs=rngs)
        self.drop = nnx.Dropout(0.1, rngs=rngs)
        self.out = nnx.Linear(8, 1, rngs=rngs)

    def __call__(self, x):
        return self.out(self.drop(self.norm(self.dense(x))))


def nnx_mutating_step(state, batch):
    def loss_fn(params):
        model = state.nnx_model(params)
        loss = jnp.mean((model(batch["x"]) - batch["y"]) ** 2)
        return loss, state.nnx_extras(model)

    (loss, extras), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
    return state.apply_gradients(grads=grads, extras=extras), {"loss": loss}


def test_an_nnx_model_with_batch_norm_and_dropout_keeps_its_mutated_state():
    def init_fn():
        return jm.TrainState.from_nnx(Noisy(nnx.Rngs(0)), tx=optax.adam(0.05))

    start = init_fn()
    losses, sess = losses_through_session(nnx_mutating_step, init_fn, steps=40)
    assert np.mean(losses[-5:]) < 0.5 * np.mean(losses[:5]), losses[::8]
    assert not np.allclose(sess.state.extras["norm"]["mean"][...], start.extras["norm"]["mean"][...])
    counts = [leaf for path, leaf in jax.tree_util.tree_leaves_with_path(sess.state.extras) if "count" in str(path)]
    assert counts and all(int(c) > 0 for c in counts)  # dropout drew fresh randomness each step
    assert sess.compile_count == 1


def test_next_rng_splits_and_advances_the_key():
    state = jm.TrainState.create(apply_fn=None, params={"w": jnp.ones(2)}, tx=optax.sgd(0.1), rng=3)
    state2, key = state.next_rng()
    assert not np.array_equal(state2.rng, state.rng) and not np.array_equal(key, state2.rng)
    assert state.step.dtype == jnp.int32
    with pytest.raises(ValueError, match="no rng"):
        state.replace(rng=None).next_rng()
    with pytest.raises(ValueError, match="from_nnx"):
        state.nnx_model()
