"""Small Flax models for config-driven experiments (`model: {"name": "jaxmon.models:CNN"}`):
an `MLP`, a `CNN`, and a causal `Transformer` language model whose parameters carry
logical axis names (`TRANSFORMER_RULES` shards them over a data/fsdp/tensor mesh), with
its documented count of FLOPs a token (`transformer_flops_per_token`).

Example:
  >>> import jax, jax.numpy as jnp
  >>> from jaxmon.models import MLP
  >>> params = MLP(features=(16,), num_outputs=3).init(jax.random.PRNGKey(0), jnp.ones((2, 4)))
  >>> MLP(features=(16,), num_outputs=3).apply(params, jnp.ones((2, 4))).shape
  (2, 3)
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["CNN", "MLP", "TRANSFORMER_RULES", "Transformer", "attention_implementation", "transformer_flops_per_token"]


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


#: Flax logical-axis rules for a mesh with axes ("data", "fsdp", "tensor"): the batch
#: over data and fsdp, parameters' embedding axis over fsdp (an array whose batch axis
#: already holds fsdp keeps its embedding axis whole), vocabulary, MLP and heads over
#: tensor; positions, per-head features and stacked layers unsharded. Use them with
#: `nn.logical_to_mesh_sharding(nn.get_partition_spec(abstract), mesh, TRANSFORMER_RULES)`
#: for the parameters, and `with nn.logical_axis_rules(TRANSFORMER_RULES):` around a
#: traced call to constrain the activations too.
TRANSFORMER_RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
    ("batch", ("data", "fsdp")),
    ("embed", "fsdp"),
    ("vocab", "tensor"),
    ("mlp", "tensor"),
    ("heads", "tensor"),
    ("length", None),
    ("kv", None),
    ("layers", None),
)


def _partitioned(init: Callable[..., Any], *names: str | None) -> Callable[..., Any]:
    """`init`, its parameters boxed with the logical axis `names` (one per dimension)."""
    return nn.with_logical_partitioning(init, names)


_DENSE_INIT = nn.initializers.lecun_normal()
_ZEROS, _ONES = nn.initializers.zeros_init(), nn.initializers.ones_init()


def _dense(features: int, names: tuple[str, str], dtype: Any, name: str, param_dtype: Any = jnp.float32) -> nn.Dense:
    """A `Dense(features)` whose kernel has the logical axes `names` (in, out), its bias the last."""
    return nn.Dense(features, dtype=dtype, param_dtype=param_dtype, name=name,
                    kernel_init=_partitioned(_DENSE_INIT, *names), bias_init=_partitioned(_ZEROS, names[-1]))


def _layer_norm(dtype: Any, name: str, param_dtype: Any = jnp.float32) -> nn.LayerNorm:
    """A LayerNorm over the embedding axis, its scale and bias named "embed"."""
    return nn.LayerNorm(dtype=dtype, param_dtype=param_dtype, name=name, scale_init=_partitioned(_ONES, "embed"),
                        bias_init=_partitioned(_ZEROS, "embed"))


class _DenseGeneral(nn.Module):
    """`x @ kernel + bias` contracting the last `len(names) - len(features)` axes of `x`,
    the kernel of shape (those axes) + `features` made whole, with the logical axes
    `names` (its LeCun-normal fan-in: the contracted axes), the bias `features` with
    the last names (none with `use_bias=False`). (`nn.DenseGeneral` initialises a flat kernel and reshapes it, which
    fails under a global mesh when the kernel carries more names than the flat shape.)"""

    features: tuple[int, ...]
    names: tuple[str, ...]
    dtype: Any = jnp.float32
    use_bias: bool = True
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jnp.ndarray) -> jnp.ndarray:
        n_in = len(self.names) - len(self.features)
        contracted = tuple(range(n_in))
        init = nn.initializers.lecun_normal(in_axis=contracted, out_axis=tuple(range(n_in, len(self.names))))
        kernel = self.param("kernel", _partitioned(init, *self.names), x.shape[-n_in:] + tuple(self.features),
                            self.param_dtype)
        x, kernel = nn.dtypes.promote_dtype(x, kernel, dtype=self.dtype)
        y = jnp.tensordot(x, kernel, axes=(tuple(range(x.ndim - n_in, x.ndim)), contracted))
        if not self.use_bias:
            return y
        bias = self.param("bias", _partitioned(_ZEROS, *self.names[n_in:]), tuple(self.features),
                          self.param_dtype).astype(y.dtype)
        return y + bias.reshape((1,) * (y.ndim - bias.ndim) + bias.shape)


def attention_implementation(dtype: Any, head_dim: int, platform: str | None = None) -> str:
    """Which implementation of `jax.nn.dot_product_attention` a block's attention asks for:
    "cudnn" (cuDNN's fused flash attention) on a GPU for bfloat16 or float16 with at most
    128 features a head, a multiple of 8; else "xla" (which `implementation=None` also
    means in JAX today). `platform`: JAX's default backend unless given.

    Example:
      >>> import jax.numpy as jnp
      >>> attention_implementation(jnp.bfloat16, 64, "gpu"), attention_implementation(jnp.float32, 64, "gpu")
      ('cudnn', 'xla')
    """
    platform = jax.default_backend() if platform is None else platform
    fits = jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)) and head_dim <= 128
    return "cudnn" if platform == "gpu" and fits and head_dim % 8 == 0 else "xla"


class _CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention: q, k, v of shape (batch, length, heads, kv),
    each position attending to itself and the positions before it, through
    `jax.nn.dot_product_attention` (cuDNN's fused attention where
    `attention_implementation` says the GPU and the shapes allow, and cuDNN takes them;
    XLA's elsewhere, the scores and their softmax in float32). The keys have no
    bias: it would add the same amount to each of a query's scores, which the softmax
    ignores (its gradient is zero but for rounding, which Adam would amplify)."""

    num_heads: int
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jnp.ndarray) -> jnp.ndarray:
        embed_dim = x.shape[-1]
        if embed_dim % self.num_heads:
            raise ValueError(f"Transformer embed_dim={embed_dim} is not a multiple of num_heads={self.num_heads}; "
                             "give an embed_dim that num_heads divides.")
        head_dim = embed_dim // self.num_heads

        def project(name: str) -> jnp.ndarray:
            dense = _DenseGeneral((self.num_heads, head_dim), ("embed", "heads", "kv"), self.dtype,
                                  use_bias=name != "key", param_dtype=self.param_dtype, name=name)
            return nn.with_logical_constraint(dense(x), ("batch", "length", "heads", "kv"))

        q, k, v = project("query"), project("key"), project("value")
        attend = functools.partial(jax.nn.dot_product_attention, q, k, v, scale=1 / np.sqrt(head_dim), is_causal=True)
        implementation = attention_implementation(q.dtype, head_dim)
        try:
            heads = attend(implementation=implementation)
        except (NotImplementedError, RuntimeError, ValueError):
            if implementation == "xla":
                raise
            heads = attend(implementation="xla")  # this GPU's or cuDNN's limits: XLA's
        return _DenseGeneral((embed_dim,), ("heads", "kv", "embed"), self.dtype, param_dtype=self.param_dtype,
                             name="out")(heads)


class _Block(nn.Module):
    """A pre-norm block: `x + attention(norm(x))`, then `x + mlp(norm(x))`; returns
    `(x, None)`, a step of `nn.scan` over the layers (`Transformer.scan_layers`)."""

    num_heads: int
    mlp_dim: int
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jnp.ndarray, _: Any = None) -> tuple[jnp.ndarray, None]:
        embed_dim, dtype, param_dtype = x.shape[-1], self.dtype, self.param_dtype
        attention = _CausalSelfAttention(self.num_heads, dtype, param_dtype, name="attention")
        x = x + attention(_layer_norm(dtype, "attention_norm", param_dtype)(x))
        x = nn.with_logical_constraint(x, ("batch", "length", "embed"))
        h = _dense(self.mlp_dim, ("embed", "mlp"), dtype, "mlp_in", param_dtype)(
            _layer_norm(dtype, "mlp_norm", param_dtype)(x))
        h = nn.with_logical_constraint(nn.gelu(h), ("batch", "length", "mlp"))
        h = _dense(embed_dim, ("mlp", "embed"), dtype, "mlp_out", param_dtype)(h)
        return nn.with_logical_constraint(x + h, ("batch", "length", "embed")), None


class Transformer(nn.Module):
    """A decoder-only causal transformer language model: token embeddings plus learned
    positions, `num_layers` pre-norm blocks (causal multi-head self-attention, then a
    GELU MLP), a final LayerNorm and a linear read-out to the vocabulary.

    Every parameter carries flax logical axis names ("vocab", "embed", "length",
    "heads", "kv", "mlp"): `nn.get_partition_spec(jax.eval_shape(model.init, ...))`
    gives their logical specs, which `TRANSFORMER_RULES` maps onto a
    ("data", "fsdp", "tensor") mesh. `model.init` returns the parameters boxed
    (`nn.LogicallyPartitioned`); `nn.meta.unbox` gives the plain arrays, and
    `apply` takes either.

    Attributes:
      vocab_size: the number of token ids (inputs are ints in `[0, vocab_size)`).
      max_len: the longest input; the number of learned positions.
      num_layers: the number of transformer blocks.
      num_heads: attention heads per block (they divide `embed_dim`).
      embed_dim: the width of the residual stream.
      mlp_dim: the width of each block's hidden MLP layer.
      dtype: the computation dtype, a dtype or its name ("bfloat16"); the attention
        scores and softmax are float32 whatever it is.
      param_dtype: the parameters' dtype, a dtype or its name (default float32).
      logits_dtype: the returned logits' dtype, a dtype or its name (default float32):
        "bfloat16" for a bfloat16 model keeps them at half the memory, every token's
        row of the vocabulary; the lm task's loss works in float32 from them
        (`tasks.cross_entropy`) and keeps no float32 copy for the gradient.
      scan_layers: run the blocks as one block in a `lax.scan` (`nn.scan`), their
        parameters stacked on a leading "layers" axis (`params["blocks"]`) instead of
        `block_0`, `block_1`, ...: XLA compiles and initialises one block, not
        `num_layers` (gpt2_small on two CPU cores: its state built in 1.7 s instead of
        6.3 s, its step compiled in half the time), as MaxText's `scan_layers` and
        Levanter's stacked layers do by default; on a CPU a step of a small model runs
        slower (a loop's copies).

    Example (shapes only: `jax.eval_shape` runs nothing):
      >>> import jax, jax.numpy as jnp, flax.linen as nn
      >>> from jaxmon.models import TRANSFORMER_RULES, Transformer
      >>> model = Transformer(vocab_size=11, max_len=8, num_layers=1, embed_dim=8, mlp_dim=16, num_heads=2)
      >>> tokens = jnp.ones((3, 5), jnp.int32)
      >>> boxed = jax.eval_shape(model.init, jax.random.PRNGKey(0), tokens)["params"]
      >>> spec = nn.get_partition_spec(boxed)["block_0"]["attention"]["query"]["kernel"]
      >>> tuple(spec), tuple(nn.logical_to_mesh_axes(spec, TRANSFORMER_RULES))
      (('embed', 'heads', 'kv'), ('fsdp', 'tensor', None))
      >>> params = nn.meta.unbox(boxed)
      >>> params["block_0"]["attention"]["query"]["kernel"].shape  # (embed, heads, kv)
      (8, 2, 4)
      >>> jax.eval_shape(model.apply, {"params": params}, tokens).shape
      (3, 5, 11)
    """

    vocab_size: int
    max_len: int
    num_layers: int = 2
    num_heads: int = 4
    embed_dim: int = 64
    mlp_dim: int = 256
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32
    scan_layers: bool = False
    logits_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, tokens: jnp.ndarray) -> jnp.ndarray:
        """Logits (batch, length, vocab_size), `logits_dtype`, of int `tokens` (batch, length),
        those at position t computed from `tokens[:, :t + 1]` only."""
        if tokens.ndim != 2 or tokens.shape[1] > self.max_len:
            raise ValueError(f"Transformer takes int tokens of shape (batch, length) with length <= "
                             f"max_len={self.max_len}; got shape {tokens.shape}. Give a larger max_len or "
                             "shorter rows.")
        dtype, param_dtype = _dtype(self.dtype, "dtype"), _dtype(self.param_dtype, "param_dtype")
        embed = nn.Embed(self.vocab_size, self.embed_dim, dtype=dtype, param_dtype=param_dtype, name="embed",
                         embedding_init=_partitioned(nn.initializers.normal(1.0), "vocab", "embed"))
        position = self.param("position", _partitioned(nn.initializers.normal(0.02), "length", "embed"),
                              (self.max_len, self.embed_dim), param_dtype)
        x = embed(tokens) + jnp.asarray(position[None, :tokens.shape[1]], dtype)
        x = nn.with_logical_constraint(x, ("batch", "length", "embed"))
        if self.scan_layers:  # one block's program, its parameters stacked on a leading "layers" axis
            blocks = nn.scan(_Block, variable_axes={"params": 0}, split_rngs={"params": True}, length=self.num_layers,
                             metadata_params={nn.PARTITION_NAME: "layers"})
            x, _ = blocks(self.num_heads, self.mlp_dim, dtype, param_dtype, name="blocks")(x, None)
        for i in range(0 if self.scan_layers else self.num_layers):
            x, _ = _Block(self.num_heads, self.mlp_dim, dtype, param_dtype, name=f"block_{i}")(x)
        x = _layer_norm(dtype, "final_norm", param_dtype)(x)
        logits = _dense(self.vocab_size, ("embed", "vocab"), dtype, "readout", param_dtype)(x)
        logits = logits.astype(_dtype(self.logits_dtype, "logits_dtype"))
        return nn.with_logical_constraint(logits, ("batch", "length", "vocab"))


def transformer_flops_per_token(model: Transformer, params: Any, length: int) -> float:
    """The FLOPs a `Transformer` spends on one token of a training step (forward and
    backward), by the documented model count: 6N + 12·L·T·d (nanoGPT's `estimate_mfu`;
    PaLM, appendix B). N counts the parameters a token's matmuls use: all but the learned
    positions and the token embedding (a lookup: the read-out has weights of its own),
    biases and norms included as nanoGPT counts them; L is `num_layers`, d `embed_dim`,
    T the rows' `length`. Causal attention is not halved: 12·L·T·d counts every query
    against every key, as nanoGPT does (MaxText's newer count halves it; the two do not
    compare). The optimizer's update, the softmax and other element-wise work are not counted.

    Args:
      model: the model.
      params: its parameters (arrays or shapes, boxed or not).
      length: the tokens of one row (T).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> model = Transformer(vocab_size=11, max_len=8, num_layers=1, embed_dim=8, mlp_dim=16, num_heads=2)
      >>> params = jax.eval_shape(model.init, jax.random.PRNGKey(0), jnp.ones((1, 8), jnp.int32))["params"]
      >>> n = 8 * (3 * 8) + 2 * 8 + 8 * 8 + 8 + 8 * 16 + 16 + 16 * 8 + 8 + 4 * 8 + 2 * 8 + 8 * 11 + 11
      >>> transformer_flops_per_token(model, params, 8) == 6 * n + 12 * 1 * 8 * 8
      True
    """
    params = nn.meta.unbox(params)
    n = sum(math.prod(np.shape(leaf)) for name, tree in params.items() if name not in ("embed", "position")
            for leaf in jax.tree.leaves(tree))
    return float(6 * n + 12 * model.num_layers * length * model.embed_dim)


def _dtype(value: Any, name: str) -> np.dtype:
    """`value` as a floating dtype: a dtype, or its name ("bfloat16", "float32")."""
    try:
        dtype = jnp.dtype(value)
    except TypeError:
        dtype = None
    if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(f"Transformer {name}={value!r} is not a floating dtype; give one such as \"float32\", "
                         "\"bfloat16\" or \"float16\".")
    return dtype
