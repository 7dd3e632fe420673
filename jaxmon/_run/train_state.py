"""TrainState: Flax's train state plus an RNG, model extras and Flax NNX support."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
from flax import struct
from flax.training import train_state

if TYPE_CHECKING:
    from flax import nnx  # imported where used: it and treescope took ~0.15 s of every start-up


class TrainState(train_state.TrainState):
    """An immutable train state: Flax's `TrainState` with `rng`, `extras` and NNX.

    Fields: `step` (int32, counts `apply_gradients` calls), `apply_fn`, `params`,
    `tx`, `opt_state` as in Flax; `rng` (a PRNG key or None); `extras` (model state
    that is not trained by `tx`, e.g. batch statistics); `graphdef` (the static
    graph of a Flax NNX model, None for linen).

    Example:
      >>> import jax, jax.numpy as jnp, optax, flax.linen as nn, jaxmon as jm
      >>> model = nn.Dense(1)
      >>> params = model.init(jax.random.key(0), jnp.ones((1, 3)))["params"]
      >>> state = jm.TrainState.create(apply_fn=model.apply, params=params,
      ...                              tx=optax.sgd(0.1), rng=0)
      >>> state, key = state.next_rng()
      >>> int(state.step)
      0
    """

    rng: jax.Array | None = None
    extras: Any = None
    graphdef: Any = struct.field(pytree_node=False, default=None)

    @classmethod
    def create(cls, *, apply_fn, params, tx, rng=None, extras=None, **kwargs) -> TrainState:
        """Creates a state at step 0 with `tx` initialised on `params`.

        Args:
          apply_fn: the model's apply function (e.g. a linen module's `apply`).
          params: the trainable parameters.
          tx: an optax `GradientTransformation`.
          rng: a PRNG key, or an int seed turned into `jax.random.PRNGKey(seed)`.
          extras: model state not trained by `tx` (e.g. `batch_stats`).
        """
        if isinstance(rng, int) and not isinstance(rng, bool):
            rng = jax.random.PRNGKey(rng)
        state = super().create(apply_fn=apply_fn, params=params, tx=tx, rng=rng, extras=extras, **kwargs)
        return state.replace(step=jnp.zeros((), jnp.int32))

    @classmethod
    def from_nnx(cls, model: nnx.Module, *, tx, rng=None) -> TrainState:
        """Splits a Flax NNX model into graphdef + params (trained) + extras (the rest).

        Inside the step, rebuild the model with `state.nnx_model(params)` and hand what
        it mutated (batch statistics, dropout RNG counts) back with `nnx_extras`:

            def loss_fn(params):
                model = state.nnx_model(params)
                loss = jnp.mean((model(batch["x"]) - batch["y"]) ** 2)
                return loss, state.nnx_extras(model)

            (loss, extras), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
            state = state.apply_gradients(grads=grads, extras=extras)

        Example:
          >>> import optax, jaxmon as jm
          >>> from flax import nnx
          >>> state = jm.TrainState.from_nnx(nnx.Linear(3, 1, rngs=nnx.Rngs(0)),
          ...                                tx=optax.sgd(0.1))
          >>> state.nnx_model()(jnp.ones((2, 3))).shape
          (2, 1)
        """
        from flax import nnx

        graphdef, params, extras = nnx.split(model, nnx.Param, ...)
        state = cls.create(apply_fn=None, params=params, tx=tx, rng=rng, extras=extras)
        return state.replace(graphdef=graphdef)

    def nnx_model(self, params: Any = None) -> nnx.Module:
        """A fresh NNX model of a state made by `from_nnx`, with `params` (default: its own).

        The model is a copy, so it may be called (and mutate its batch statistics or
        RNG counts) inside `jax.grad`; take what it mutated back with `nnx_extras`.
        """
        if self.graphdef is None:
            raise ValueError("nnx_model() needs a state made by TrainState.from_nnx(model, tx=...).")
        params = self.params if params is None else params
        from flax import nnx

        return nnx.merge(self.graphdef, params, self.extras, copy=True)

    @staticmethod
    def nnx_extras(model: nnx.Module) -> Any:
        """The non-trainable state of an NNX model, in the layout `from_nnx` keeps as `extras`."""
        from flax import nnx

        return nnx.split(model, nnx.Param, ...)[2]

    def next_rng(self) -> tuple[TrainState, jax.Array]:
        """Splits `rng`: returns the state with a new key, and a key to use now."""
        if self.rng is None:
            raise ValueError("This TrainState has no rng: create it with rng=<seed or key>.")
        rng, key = jax.random.split(self.rng)
        return self.replace(rng=rng), key
