"""Small Flax models for config-driven experiments (`model: {"name": "jaxmon.models:CNN"}`).

Example:
  >>> import jax, jax.numpy as jnp
  >>> from jaxmon.models import MLP
  >>> params = MLP(features=(16,), num_outputs=3).init(jax.random.PRNGKey(0), jnp.ones((2, 4)))
  >>> MLP(features=(16,), num_outputs=3).apply(params, jnp.ones((2, 4))).shape
  (2, 3)
"""

from __future__ import annotations

from collections.abc import Sequence

import flax.linen as nn
import jax.numpy as jnp

__all__ = ["CNN", "MLP"]


class MLP(nn.Module):
    """Flattens its input, then `Dense(f) + relu` for each `f` in `features`, then
    `Dense(num_outputs)`."""

    features: Sequence[int] = (128,)
    num_outputs: int = 10

    @nn.compact
    def __call__(self, x: jnp.ndarray) -> jnp.ndarray:
        x = x.reshape((x.shape[0], -1))
        for width in self.features:
            x = nn.relu(nn.Dense(width)(x))
        return nn.Dense(self.num_outputs)(x)


class CNN(nn.Module):
    """`Conv(c, 3x3) + relu` for each `c` in `channels` (2x2 max-pooling after each but
    the first), then an `MLP` head of `features` → `num_outputs`. Input NHWC."""

    channels: Sequence[int] = (16, 32)
    features: Sequence[int] = (64,)
    num_outputs: int = 10

    @nn.compact
    def __call__(self, x: jnp.ndarray) -> jnp.ndarray:
        for i, channels in enumerate(self.channels):
            x = nn.relu(nn.Conv(channels, (3, 3))(x))
            if i > 0:
                x = nn.max_pool(x, (2, 2), strides=(2, 2))
        return MLP(self.features, self.num_outputs)(x)
