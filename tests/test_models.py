"""The parts of the character language model: `jaxmon.models.Transformer` (shapes,
causality, logical partitioning under `TRANSFORMER_RULES`, its FLOPs a token) and
`configs/lm.py`, which joins it to `jaxmon.datasets.python_text` (tested in
tests/datasets/test_python_text.py)."""

from __future__ import annotations

import math
import pathlib
import subprocess
import sys
import textwrap

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import cpu_env
from jax.sharding import PartitionSpec as P

import jaxmon as jm
from jaxmon.datasets import PYTHON_TEXT_VOCAB, python_text
from jaxmon.models import TRANSFORMER_RULES, Transformer, attention_implementation, transformer_flops_per_token

ROOT = pathlib.Path(__file__).resolve().parent.parent
MODEL = Transformer(vocab_size=16, max_len=8, num_layers=2, num_heads=2, embed_dim=8, mlp_dim=12)


@pytest.fixture(scope="module")
def params():
    """Random parameters of MODEL's shapes, unboxed (its initialisers' random numbers
    take seconds to compile on a CPU; the 8-device test runs them)."""
    boxed = jax.eval_shape(MODEL.init, jax.random.PRNGKey(0), jnp.zeros((1, 8), jnp.int32))["params"]
    rng = np.random.default_rng(0)
    return jax.tree.map(lambda leaf: jnp.asarray(rng.normal(0.0, 0.5, leaf.shape), jnp.float32),
                        nn.meta.unbox(boxed))


@pytest.fixture(scope="module")
def apply():
    return jax.jit(MODEL.apply)


# Transformer


def test_transformer_maps_tokens_to_logits(params, apply):
    tokens = jnp.asarray(np.random.default_rng(0).integers(1, 16, (3, 8)), jnp.int32)
    logits = apply({"params": params}, tokens)
    assert logits.shape == (3, 8, 16) and logits.dtype == jnp.float32
    assert np.isfinite(np.asarray(logits)).all()
    shorter = apply({"params": params}, tokens[:, :5])  # fewer positions than max_len
    np.testing.assert_allclose(shorter, logits[:, :5], rtol=1e-5, atol=1e-5)


def test_transformer_logits_at_t_ignore_later_tokens(params, apply):
    rng = np.random.default_rng(1)
    tokens = rng.integers(1, 16, (2, 8))
    base = np.asarray(apply({"params": params}, jnp.asarray(tokens, jnp.int32)))
    for t in range(7):
        changed = tokens.copy()
        changed[:, t + 1:] = rng.integers(1, 16, (2, 7 - t))
        logits = np.asarray(apply({"params": params}, jnp.asarray(changed, jnp.int32)))
        np.testing.assert_allclose(logits[:, :t + 1], base[:, :t + 1], rtol=1e-5, atol=1e-5)
        assert not np.allclose(logits[:, t + 1:], base[:, t + 1:])  # later positions do see them


def test_transformer_parameters_have_their_logical_axes_and_mesh_specs(params):
    abstract = jax.eval_shape(MODEL.init, jax.random.PRNGKey(0), jnp.zeros((1, 8), jnp.int32))["params"]
    logical = nn.get_partition_spec(abstract)
    mesh_specs = nn.logical_to_mesh(logical, TRANSFORMER_RULES)
    attention = mesh_specs["block_0"]["attention"]
    assert logical["block_0"]["attention"]["query"]["kernel"] == P("embed", "heads", "kv")
    assert logical["position"] == P("length", "embed")
    expected = {
        ("embed", "embedding"): P("tensor", "fsdp"),
        ("position",): P(None, "fsdp"),
        ("readout", "kernel"): P("fsdp", "tensor"),
        ("readout", "bias"): P("tensor"),
        ("final_norm", "scale"): P("fsdp"),
        ("block_1", "mlp_in", "kernel"): P("fsdp", "tensor"),
        ("block_1", "mlp_out", "kernel"): P("tensor", "fsdp"),
        ("block_1", "mlp_out", "bias"): P("fsdp"),
        ("block_1", "attention_norm", "bias"): P("fsdp"),
    }
    for path, spec in expected.items():
        node = mesh_specs
        for key in path:
            node = node[key]
        assert node == spec, path
    for name in ("query", "key", "value"):
        assert attention[name]["kernel"] == P("fsdp", "tensor", None)
    assert attention["query"]["bias"] == attention["value"]["bias"] == P("tensor", None)
    assert "bias" not in attention["key"]  # a key bias shifts all of a query's scores alike: no gradient
    assert attention["out"]["kernel"] == P("tensor", None, "fsdp")
    # Every parameter is annotated, one name per dimension.
    flat_specs = jax.tree.leaves(logical, is_leaf=lambda x: isinstance(x, P))
    flat_params = jax.tree.leaves(params)
    assert len(flat_specs) == len(flat_params) == 1 + 1 + 2 * 15 + 2 + 2  # embed, positions, blocks, norm, read-out
    assert [len(spec) for spec in flat_specs] == [leaf.ndim for leaf in flat_params]
    assert params["block_0"]["attention"]["query"]["kernel"].shape == (8, 2, 4)  # (embed, heads, kv)
    assert params["block_0"]["attention"]["out"]["kernel"].shape == (2, 4, 8)  # (heads, kv, embed)


def test_scanned_layers_stack_each_parameter_on_an_unsharded_layers_axis_and_compute_the_same(params, apply):
    scanned = MODEL.clone(scan_layers=True)
    tokens = jnp.asarray(np.random.default_rng(1).integers(1, 16, (2, 8)), jnp.int32)
    abstract = jax.eval_shape(scanned.init, jax.random.PRNGKey(0), tokens)["params"]
    mesh_specs = nn.logical_to_mesh(nn.get_partition_spec(abstract), TRANSFORMER_RULES)
    assert mesh_specs["blocks"]["mlp_in"]["kernel"] == P(None, "fsdp", "tensor")  # (layers, embed, mlp)
    assert mesh_specs["blocks"]["attention"]["query"]["kernel"] == P(None, "fsdp", "tensor", None)
    # The same numbers as the blocks one by one, with block i's parameters as layer i of the stack.
    stacked = {**{k: v for k, v in params.items() if not k.startswith("block_")},
               "blocks": jax.tree.map(lambda *layers: jnp.stack(layers), params["block_0"], params["block_1"])}
    np.testing.assert_allclose(np.asarray(jax.jit(scanned.apply)({"params": stacked}, tokens)),
                               np.asarray(apply({"params": params}, tokens)), rtol=1e-5, atol=1e-5)


def test_attention_asks_for_cudnn_on_a_gpu_where_its_shapes_allow_and_xla_elsewhere():
    assert attention_implementation(jnp.bfloat16, 64, "gpu") == attention_implementation(jnp.float16, 128, "gpu") \
        == "cudnn"
    for dtype, head_dim, platform in [(jnp.float32, 64, "gpu"), (jnp.bfloat16, 256, "gpu"), (jnp.bfloat16, 60, "gpu"),
                                      (jnp.bfloat16, 64, "cpu"), (jnp.bfloat16, 64, "tpu")]:
        assert attention_implementation(dtype, head_dim, platform) == "xla", (dtype, head_dim, platform)


def test_bfloat16_logits_are_the_float32_ones_rounded(params):
    tokens = jnp.asarray(np.random.default_rng(2).integers(1, 16, (2, 8)), jnp.int32)
    low = jax.jit(MODEL.clone(logits_dtype="bfloat16").apply)({"params": params}, tokens)
    assert low.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(low), np.asarray(MODEL.apply({"params": params}, tokens).astype(
        jnp.bfloat16)))


def test_transformer_rules_shard_the_batch_before_the_embedding():
    assert nn.logical_to_mesh_axes(("batch", "length", "embed"), TRANSFORMER_RULES) == P(("data", "fsdp"), None, None)
    assert nn.logical_to_mesh_axes(("batch", "length", "vocab"), TRANSFORMER_RULES) == P(("data", "fsdp"), None,
                                                                                         "tensor")


def test_transformer_flops_a_token_at_gpt2_small_shapes_are_the_documented_count():
    model = Transformer(vocab_size=128, max_len=1024, num_layers=12, num_heads=12, embed_dim=768, mlp_dim=3072)
    boxed = jax.eval_shape(model.init, jax.random.PRNGKey(0), jnp.zeros((1, 1024), jnp.int32))["params"]
    total = sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(nn.meta.unbox(boxed)))
    n = total - 128 * 768 - 1024 * 768  # less the token embedding (a lookup) and the learned positions
    assert total == 86_029_952 and transformer_flops_per_token(model, boxed, 1024) == 6 * n + 12 * 12 * 1024 * 768
    assert transformer_flops_per_token(model, nn.meta.unbox(boxed), 1024) == pytest.approx(6.24e8, rel=1e-3)


def test_transformer_refuses_rows_longer_than_max_len_and_odd_heads(params):
    with pytest.raises(ValueError, match=r"max_len=8; got shape \(1, 9\)"):
        jax.eval_shape(MODEL.apply, {"params": params}, jnp.zeros((1, 9), jnp.int32))
    odd = Transformer(vocab_size=4, max_len=2, num_heads=3, embed_dim=8)
    with pytest.raises(ValueError, match="embed_dim=8 is not a multiple of num_heads=3"):
        jax.eval_shape(odd.init, jax.random.PRNGKey(0), jnp.zeros((1, 2), jnp.int32))


_SHARDED = textwrap.dedent("""
    import flax.linen as nn, jax, jax.numpy as jnp, numpy as np
    from jaxmon.models import TRANSFORMER_RULES, Transformer, transformer_flops_per_token
    model = Transformer(vocab_size=16, max_len=8, num_layers=1, num_heads=2, embed_dim=8, mlp_dim=12)
    tokens = jnp.asarray(np.random.default_rng(0).integers(1, 16, (4, 8)), jnp.int32)
    boxed = jax.jit(model.init)(jax.random.key(0, impl="rbg"), tokens)["params"]
    assert isinstance(boxed["block_0"]["attention"]["query"]["kernel"], nn.LogicallyPartitioned)
    params = nn.meta.unbox(boxed)
    leaves = jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, nn.meta.AxisMetadata))  # a box is a leaf here
    assert len(leaves) == 2 + 15 + 4 and all(isinstance(leaf, jax.Array) for leaf in leaves)
    expected = jax.jit(model.apply)({"params": params}, tokens)
    mesh = jax.make_mesh((2, 2, 2), ("data", "fsdp", "tensor"), axis_types=(jax.sharding.AxisType.Auto,) * 3)
    shardings = nn.logical_to_mesh_sharding(nn.get_partition_spec(boxed), mesh, TRANSFORMER_RULES)
    sharded = jax.device_put(params, shardings)
    assert sharded["readout"]["kernel"].sharding.spec == jax.sharding.PartitionSpec("fsdp", "tensor")
    assert len(sharded["readout"]["kernel"].addressable_shards[0].data.reshape(-1)) == 8 * 16 // 4
    with jax.set_mesh(mesh), nn.logical_axis_rules(TRANSFORMER_RULES):  # activations constrained too
        batch = jax.device_put(tokens, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(("data", "fsdp"))))
        logits = jax.jit(model.apply)({"params": sharded}, batch)
    np.testing.assert_allclose(logits, expected, rtol=1e-5, atol=1e-5)
    print("sharding", tuple(logits.sharding.spec))
""")


def test_transformer_applies_sharded_over_an_8_device_mesh():
    """Parameters placed by TRANSFORMER_RULES on a 2x2x2 mesh, applied under a global
    mesh and the rules (the activations constrained too), give the unsharded logits."""
    result = subprocess.run([sys.executable, "-c", _SHARDED], env=cpu_env(8), cwd=ROOT, capture_output=True,
                            text=True, timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "sharding (('data', 'fsdp'), None, 'tensor')" in result.stdout


# configs/lm.py


def test_lm_config_builds_its_model_and_data():
    config = jm.load_config(ROOT / "configs" / "lm.py")
    model_config, data_config = dict(config["model"]), dict(config["data"])
    assert model_config.pop("name") == "jaxmon.models:Transformer" and config["task"] == "lm"
    assert data_config.pop("source") == "jaxmon.datasets:python_text"
    model = Transformer(**model_config)
    test = python_text(data_config["eval_split"], seq_len=data_config["seq_len"],
                       test_fraction=data_config["test_fraction"])
    assert model.vocab_size == PYTHON_TEXT_VOCAB and model.max_len == data_config["seq_len"]
    logits = jax.eval_shape(lambda: model.apply(model.init(jax.random.PRNGKey(0), test["x"][:2]), test["x"][:2]))
    assert logits.shape == (2, data_config["seq_len"], PYTHON_TEXT_VOCAB)
    assert config["optimizer"]["learning_rate"]["decay_steps"] == config["steps"]


# -- attention and dtypes ------------------------------------------------------------------------


def softmax_attention(q, k, v):
    """The reference: causal softmax attention written out, scores and softmax in float32."""
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) / np.sqrt(q.shape[-1])
    length = q.shape[1]
    scores = jnp.where(jnp.tril(jnp.ones((1, 1, length, length), bool)), scores, jnp.finfo(jnp.float32).min)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1).astype(q.dtype), v)


def test_the_attention_matches_the_softmax_reference():
    from jaxmon.models import _CausalSelfAttention

    attention = _CausalSelfAttention(num_heads=4)
    x = jax.random.normal(jax.random.PRNGKey(1), (3, 9, 16))
    params = nn.meta.unbox(attention.init(jax.random.PRNGKey(0), x)["params"])

    def project(name):
        out = jnp.tensordot(x, params[name]["kernel"], axes=((2,), (0,)))
        return out + params[name]["bias"][None, None] if "bias" in params[name] else out

    heads = softmax_attention(project("query"), project("key"), project("value"))
    expected = jnp.tensordot(heads, params["out"]["kernel"], axes=((2, 3), (0, 1))) + params["out"]["bias"][None, None]
    np.testing.assert_allclose(attention.apply({"params": params}, x), expected, rtol=1e-5, atol=1e-5)


def test_the_transformer_takes_dtypes_by_name_and_keeps_its_logits_in_float32():
    tokens = jnp.ones((2, 6), jnp.int32)
    model = Transformer(vocab_size=11, max_len=8, num_layers=1, embed_dim=8, mlp_dim=16, num_heads=2,
                        dtype="bfloat16", param_dtype="bfloat16")
    params = nn.meta.unbox(model.init(jax.random.PRNGKey(0), tokens)["params"])
    assert {leaf.dtype for leaf in jax.tree.leaves(params)} == {jnp.dtype(jnp.bfloat16)}
    logits = model.apply({"params": params}, tokens)
    assert logits.dtype == jnp.float32 and logits.shape == (2, 6, 11) and bool(jnp.isfinite(logits).all())
    mixed = Transformer(vocab_size=11, max_len=8, num_layers=1, embed_dim=8, mlp_dim=16, num_heads=2,
                        dtype="bfloat16")  # bfloat16 compute on float32 parameters
    params = nn.meta.unbox(mixed.init(jax.random.PRNGKey(0), tokens)["params"])
    assert {leaf.dtype for leaf in jax.tree.leaves(params)} == {jnp.dtype(jnp.float32)}
    full = Transformer(vocab_size=11, max_len=8, num_layers=1, embed_dim=8, mlp_dim=16, num_heads=2)
    np.testing.assert_allclose(mixed.apply({"params": params}, tokens), full.apply({"params": params}, tokens),
                               atol=0.1)  # bfloat16 keeps ~3 significant digits


@pytest.mark.parametrize("bad", ["bf16", "int32"])
def test_a_dtype_that_is_not_a_floating_one_is_named(bad):
    model = Transformer(vocab_size=11, max_len=8, num_layers=1, embed_dim=8, mlp_dim=16, num_heads=2, dtype=bad)
    with pytest.raises(ValueError, match=rf"Transformer dtype='{bad}' is not a floating dtype"):
        model.init(jax.random.PRNGKey(0), jnp.ones((2, 6), jnp.int32))


def test_the_gpt2_small_config_is_gpt2_smalls_shape_in_bfloat16():
    config = jm.load_config(ROOT / "configs" / "gpt2_small.py")
    model_config = dict(config["model"])
    model_config.pop("name")
    model = Transformer(**model_config)
    shapes = jax.eval_shape(model.init, jax.random.PRNGKey(0), jnp.ones((2, 1024), jnp.int32))
    count = sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(nn.meta.unbox(shapes)))
    assert 85e6 < count < 87e6  # 12 x 768 with the byte vocabulary
    assert (model.num_layers, model.embed_dim, model.num_heads, model.max_len) == (12, 768, 12, 1024)
    assert (model.dtype, model.param_dtype) == ("bfloat16", "float32") and config["data"]["seq_len"] == 1024
