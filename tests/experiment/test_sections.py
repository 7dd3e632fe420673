"""The `perf` section of `jaxmon train` (`sections.throughput_of`): rates, tokens, TFLOP/s
from XLA's count of the step, and MFU against the config's peak, read back from
metrics.jsonl against a hand count; figures given in the section; bad figures refused."""

import json
import subprocess
import sys

import jax
import numpy as np
import pytest
from helpers import ROOT, cpu_env

import jaxmon as jm
from jaxmon._experiment.parts import parts_of
from jaxmon._experiment.sections import session_args_of, throughput_of

OVERRIDES = ["--config.steps=40", "--config.optimizer.learning_rate.decay_steps=40",
             "--config.optimizer.learning_rate.warmup_steps=5", "--config.model.num_layers=1",
             "--config.perf.every_n_steps=20", "--config.perf.peak_tflops=0.5"]


def test_an_lm_run_writes_perf_summaries_whose_mfu_is_the_hand_count(tmp_path):
    done = subprocess.run([sys.executable, "-m", "jaxmon", "train", "--config", "configs/lm.py", *OVERRIDES,
                           "--workdir", str(tmp_path / "run")], cwd=ROOT, env=cpu_env(), capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    with open(tmp_path / "run" / "metrics.jsonl") as lines:
        rows = [row for row in map(json.loads, lines) if "perf/mfu" in row]
    assert [row["step"] for row in rows] == [20, 40]
    # by hand: the step lowered on the state's shapes and one batch, XLA's cost analysis of it
    config = jm.load_config(ROOT / "configs" / "lm.py", [o.removeprefix("--config.") for o in OVERRIDES])
    parts = parts_of(config)
    batch = {key: np.asarray(value[:parts.data.batch_size]) for key, value in parts.data.train.items()}
    flops = jax.jit(parts.task.step_fn).lower(jax.eval_shape(parts.init_fn), batch).cost_analysis()["flops"]
    for row in rows:
        rate = row["perf/steps_per_sec"]
        assert row["perf/examples_per_sec"] == pytest.approx(16 * rate)
        assert row["perf/tokens_per_sec"] == pytest.approx(16 * 64 * rate)  # batch 16, rows of 64 tokens
        assert row["perf/tflops_per_sec_per_device"] == pytest.approx(flops * rate / 1e12)  # one device
        assert row["perf/mfu"] == pytest.approx(flops * rate / 1e12 / 0.5)


def test_figures_in_the_perf_section_take_the_place_of_the_counted_ones(tmp_path):
    config = jm.load_config(ROOT / "configs" / "lm.py", ["perf.flops_per_step=1e9", "perf.examples_per_step=8"])
    hook = throughput_of(config, lambda state, batch: (state, {}), batch_size=16, row=np.zeros(64),
                         workdir=str(tmp_path))
    assert (hook._flops, hook._examples, hook._tokens) == (1e9, 8, 16 * 64)


def test_a_peak_that_is_no_positive_number_is_refused_with_its_value(tmp_path):
    done = subprocess.run([sys.executable, "-m", "jaxmon", "train", "--config", "configs/lm.py",
                           "--config.perf.peak_tflops=-1", "--workdir", str(tmp_path / "bad")], cwd=ROOT,
                          env=cpu_env(), capture_output=True, text=True, timeout=300)
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
