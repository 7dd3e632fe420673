"""The `perf` section of `jaxmon train` (`sections.throughput_of`): a small gpt2_small's
rates, tokens, TFLOP/s from the model's documented count and MFU against the config's
peak, read back from metrics.jsonl against a hand count, every row an example with
accumulated gradients; bad figures refused."""

import json

import jax
import numpy as np
import pytest
from helpers import ROOT, cpu_env, run_jaxmon

import jaxmon as jm
from jaxmon._experiment.parts import parts_of
from jaxmon._experiment.sections import optimizer_of, session_args_of, throughput_of

#: configs/gpt2_small.py made small: 1 layer of 32, rows of 32 tokens, 4 a step in 2 micro-batches of 2.
OVERRIDES = ["--config.steps=40", "--config.optimizer.learning_rate.decay_steps=40",
             "--config.optimizer.learning_rate.warmup_steps=5", "--config.optimizer.accumulate_steps=2",
             "--config.model.num_layers=1", "--config.model.num_heads=2", "--config.model.embed_dim=32",
             "--config.model.mlp_dim=64", "--config.model.max_len=32", "--config.data.seq_len=32",
             "--config.data.batch_size=4", "--config.perf.every_n_steps=20", "--config.perf.peak_tflops=0.5",
             "--config.session.save_summaries_steps=20"]


def config_rate_peak():
    return jm.load_config(ROOT / "configs" / "gpt2_small.py")["optimizer"]["learning_rate"]["peak_value"]


def test_a_small_gpt2_writes_perf_summaries_from_the_models_flop_count(tmp_path):
    done = run_jaxmon(["train", "--config", "configs/gpt2_small.py", *OVERRIDES, "--workdir", tmp_path / "run"],
                      cwd=ROOT, env=cpu_env(), timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    with open(tmp_path / "run" / "metrics.jsonl") as lines:
        rows = [row for row in map(json.loads, lines) if "perf/mfu" in row]
    assert [row["step"] for row in rows] == [20, 40]
    with open(tmp_path / "run" / "metrics.jsonl") as lines:
        summaries = [row for row in map(json.loads, lines) if "grad_norm" in row]
    assert [row["step"] for row in summaries] == [1, 20, 40]  # the summary cadence (the first step too)
    assert summaries[0]["learning_rate"] == 0.0  # the warm-up's first update
    for row in summaries:  # the steps' gradient norm and learning rate, means of the window
        assert row["grad_norm"] > 0 and 0 <= row["learning_rate"] <= config_rate_peak(), row
    assert summaries[1]["learning_rate"] > 0 and summaries[2]["learning_rate"] > 0
    # by hand: 6N + 12·L·T·d a token, N all parameters but the token embedding and the positions
    config = jm.load_config(ROOT / "configs" / "gpt2_small.py", [o.removeprefix("--config.") for o in OVERRIDES])
    params = jax.eval_shape(parts_of(config).init_fn).params
    n = sum(np.prod(leaf.shape) for name, tree in params.items() if name not in ("embed", "position")
            for leaf in jax.tree.leaves(tree))
    assert n == 1 * (4 * 32 * 32 + 3 * 32 + 2 * 32 * 64 + 64 + 32 + 4 * 32) + 2 * 32 + 32 * 128 + 128
    flops = 4 * 32 * (6 * n + 12 * 1 * 32 * 32)  # 4 rows of 32 tokens a step
    for row in rows:
        rate = row["perf/steps_per_sec"]
        assert row["perf/examples_per_sec"] == pytest.approx(4 * rate)  # a step is 4 rows, in 2 micro-batches
        assert row["perf/tokens_per_sec"] == pytest.approx(4 * 32 * rate)
        assert row["perf/tflops_per_sec_per_device"] == pytest.approx(flops * rate / 1e12)  # one device
        assert row["perf/mfu"] == pytest.approx(flops * rate / 1e12 / 0.5)
    assert "perf: " not in done.stderr  # no figure said missing


def test_figures_in_the_perf_section_take_the_place_of_the_counted_ones(tmp_path):
    config = jm.load_config(ROOT / "configs" / "gpt2_small.py", ["perf.flops_per_step=1e9",
                                                                 "perf.examples_per_step=8"])
    hook = throughput_of(config, lambda state, batch: (state, {}), batch_size=32, row=np.zeros(1024),
                         workdir=str(tmp_path), model=parts_of(config).context.model)
    assert (hook._flops, hook._flops_of, hook._examples, hook._tokens) == (1e9, None, 8, 32 * 1024)


def test_a_peak_that_is_no_positive_number_is_refused_with_its_value(tmp_path):
    done = run_jaxmon(["train", "--config", "configs/lm.py", "--config.perf.peak_tflops=-1", "--workdir",
                       tmp_path / "bad"], cwd=ROOT, env=cpu_env(), timeout=300)
    assert done.returncode == 2 and "perf.peak_tflops=-1" in done.stderr, done.stderr[-2000:]


@pytest.mark.parametrize(("perf", "words"), [
    ({"flops_per_step": 0}, "perf.flops_per_step=0: give the FLOPs of one step, all devices together (a number > 0)"),
    ({"tokens_per_step": "many"}, "perf.tokens_per_step='many': give the tokens of one step"),
    ({"every_n_steps": 10, "peak": 1}, "perf has unknown keys ['peak']; it takes every_n_steps, peak_tflops, "
                                       "flops_per_step, examples_per_step, tokens_per_step."),
])
def test_a_bad_perf_section_is_refused_naming_the_key(tmp_path, perf, words):
    with pytest.raises(jm.ConfigError) as error:
        throughput_of({"perf": perf}, lambda state, batch: (state, {}), batch_size=8, row=np.zeros(3),
                      workdir=str(tmp_path))
    assert str(error.value).startswith(words)


def test_a_figure_in_the_session_section_is_sent_to_the_perf_section():
    with pytest.raises(jm.ConfigError, match=r"^session.peak_tflops goes in the perf section: give "
                                             r"perf.peak_tflops instead.$"):
        session_args_of({"session": {"peak_tflops": 989}})


# -- optimizer ------------------------------------------------------------------------------------

PARAMS = {"dense": {"kernel": np.ones((2, 3), np.float32), "bias": np.ones(3, np.float32)},
          "norm": {"scale": np.ones(3, np.float32)}}


def decayed(spec):
    """Which parameters one update of `spec`'s optimizer decays: with zero gradients, only
    weight decay moves a parameter."""
    tx = optimizer_of(dict(spec))
    updates, _ = tx.update(jax.tree.map(np.zeros_like, PARAMS), tx.init(PARAMS), PARAMS)
    return {path: bool(np.any(np.asarray(update) != 0))
            for path, update in jax.tree_util.tree_leaves_with_path(updates)}


def paths(*names):
    return {path: jax.tree_util.keystr(path) in names
            for path, _ in jax.tree_util.tree_leaves_with_path(PARAMS)}


@pytest.fixture
def masks(tmp_path, monkeypatch):
    """A module `masks` with a mask function of the parameters (all but the norm's)."""
    (tmp_path / "masks.py").write_text(
        "import jax\n\n"
        "def no_norm(params):\n"
        "    return {name: jax.tree.map(lambda _: name != 'norm', tree) for name, tree in params.items()}\n\n"
        "NOT_A_FUNCTION = 3\n")
    monkeypatch.syspath_prepend(str(tmp_path))


@pytest.mark.parametrize("name", ["adamw", "lion", "lamb", "nadamw"])
def test_weight_decay_takes_the_matrices_only_by_default(name):
    moved = decayed({"name": name, "learning_rate": 0.1, "weight_decay": 0.5})
    assert moved == paths("['dense']['kernel']")  # not the bias, nor the norm's scale


def test_weight_decay_mask_all_decays_every_parameter_and_a_path_names_a_function(masks):
    spec = {"name": "adamw", "learning_rate": 0.1, "weight_decay": 0.5}
    assert all(decayed({**spec, "weight_decay_mask": "all"}).values())
    moved = decayed({**spec, "weight_decay_mask": "masks:no_norm"})
    assert moved == paths("['dense']['kernel']", "['dense']['bias']")
    assert all(decayed({**spec, "mask": None}).values())  # optax's own argument wins


@pytest.mark.parametrize("spec, words", [
    ({"name": "adam", "learning_rate": 0.1, "weight_decay_mask": "all"},
     "optimizer.weight_decay_mask='all': optax.adam has no weight decay to mask"),
    ({"name": "adamw", "learning_rate": 0.1, "weight_decay_mask": "matrix"},
     "optimizer.weight_decay_mask='matrix': give 'matrices' (the default), 'all', or the import path"),
    ({"name": "adamw", "learning_rate": 0.1, "weight_decay_mask": "masks:NOT_A_FUNCTION"},
     "optimizer.weight_decay_mask='masks:NOT_A_FUNCTION' is 3, not a function of the parameters"),
])
def test_a_bad_weight_decay_mask_is_one_config_error_naming_the_fix(masks, spec, words):
    with pytest.raises(jm.ConfigError) as raised:
        optimizer_of(dict(spec))
    assert words in str(raised.value)


def test_an_adam_without_weight_decay_is_as_before():
    moved = decayed({"name": "adam", "learning_rate": 0.1})
    assert not any(moved.values())


def test_the_lm_configs_adamw_decays_the_transformers_matrices_only():
    config = jm.load_config(ROOT / "configs" / "lm.py", ["model.num_layers=1", "model.embed_dim=16",
                                                          "model.mlp_dim=32", "model.num_heads=2",
                                                          "optimizer.learning_rate.init_value=0.1"])
    parts = parts_of(config)
    params = parts.init_fn().params
    tx = parts.context.optimizer
    updates, _ = jax.jit(tx.update)(jax.tree.map(np.zeros_like, params), tx.init(params), params)
    moved = {jax.tree_util.keystr(path): (np.ndim(leaf), bool(np.any(np.asarray(update) != 0)))
             for (path, leaf), update in zip(jax.tree_util.tree_leaves_with_path(params), jax.tree.leaves(updates),
                                             strict=True)}
    decayed = {path for path, (_, decays) in moved.items() if decays}
    assert decayed == {path for path, (ndim, _) in moved.items()
                       if ndim >= 2 and not path.endswith(("['bias']", "['scale']"))}, moved
    assert any(path.endswith("['query']['bias']") and ndim == 2 for path, (ndim, _) in moved.items())
    assert "['embed']['embedding']" in decayed and "['block_0']['mlp_in']['kernel']" in decayed, decayed
