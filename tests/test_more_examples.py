"""The examples in examples/ run as programs, and what they print and write holds up."""

import json
import os
import pathlib
import re
import subprocess
import sys

import jax
import numpy as np
import pytest
import warm_processes
from helpers import cpu_env

import jaxmon as jm

ROOT = pathlib.Path(__file__).resolve().parents[1]


def run_example(name: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")}
    result = warm_processes.run([sys.executable, str(ROOT / "examples" / name), *args], capture_output=True,
                                text=True, timeout=240, cwd=ROOT, env=env)
    assert result.returncode == 0, f"{name} failed:\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}"
    return result


def last_line(result: subprocess.CompletedProcess) -> str:
    return result.stdout.strip().splitlines()[-1]


def test_custom_validation_hook_tracks_accuracy_with_one_compilation(tmp_path):
    result = run_example("custom_hook.py", "--steps", "120", "--every", "40", "--workdir", str(tmp_path))
    match = re.fullmatch(r"final validation accuracy ([\d.]+) \(loss ([\d.]+)\) after 120 steps", last_line(result))
    assert match, result.stdout
    summary = json.loads((tmp_path / "history.json").read_text())
    history = summary["history"]
    assert [entry["step"] for entry in history] == [0, 40, 80, 120]
    assert summary["eval_compilations"] == 1
    first, final = history[0], history[-1]
    assert first["accuracy"] < 0.3  # ten classes: chance is 0.1
    assert final["accuracy"] > 0.85 and final["loss"] < first["loss"] / 4
    assert float(match[1]) == round(final["accuracy"], 4)
    # Each evaluation was also printed as it happened.
    printed = re.findall(r"step +(\d+) +validation loss ([\d.]+) +accuracy ([\d.]+)", result.stdout)
    assert [int(step) for step, _, _ in printed] == [0, 40, 80, 120]
    assert [float(acc) for _, _, acc in printed] == [round(entry["accuracy"], 4) for entry in history]


def test_warm_start_takes_the_shared_trunk_and_then_resumes_from_its_own_checkpoint(tmp_path):
    result = run_example("warm_start.py", "--steps", "60", "--workdir", str(tmp_path))
    summary = json.loads((tmp_path / "summary.json").read_text())
    trunk = {f"params/{layer}/{leaf}" for layer in ("trunk_0", "trunk_1") for leaf in ("kernel", "bias")}
    assert set(summary["restored"]) == trunk  # the model only: the optimizer and step start fresh
    assert "step" in summary["skipped"] and "opt_state/0/mu/trunk_0/kernel" in summary["skipped"]
    assert not [leaf for leaf in summary["restored"] if "head" in leaf]
    head = [leaf for leaf in summary["mismatched"] if leaf.startswith("params/head/")]
    assert sorted(leaf.split(" ")[0] for leaf in head) == ["params/head/bias", "params/head/kernel"]
    assert "params/head/kernel (checkpoint float32[64, 10], state float32[64, 3])" in head
    assert summary["start_step"] == 0 and summary["trunk_restored"] and summary["head_fresh"]
    assert summary["resumed_at"] == 30 and summary["second_warm_start_report"] is None
    assert summary["resumed_params_equal"]
    assert "resumed at step 30 from its own checkpoint" in last_line(result)

    # The checkpoints themselves: fine-tuning's step 0 holds the pre-trained trunk and a
    # head of the new shape; it then saved its own steps up to 60.
    pretrained = jm.restore_checkpoint(tmp_path / "pretrain").state["params"]
    warm = jm.restore_checkpoint(tmp_path / "finetune", step=0).state["params"]
    for layer in ("trunk_0", "trunk_1"):
        for leaf in ("kernel", "bias"):
            np.testing.assert_array_equal(warm[layer][leaf], pretrained[layer][leaf])
    assert pretrained["head"]["kernel"].shape == (64, 10) and warm["head"]["kernel"].shape == (64, 3)
    final = jm.restore_checkpoint(tmp_path / "finetune")
    assert final.step == 60 and final.meta["step"] == 60
    assert not np.array_equal(final.state["params"]["trunk_0"]["kernel"], warm["trunk_0"]["kernel"])


def test_nnx_model_trains_with_built_in_hooks(tmp_path):
    result = run_example("nnx_model.py", "--steps", "150", "--workdir", str(tmp_path))
    match = re.fullmatch(r"train loss ([\d.]+) -> ([\d.]+) \(mean of the first and last (\d+) steps\), "
                         r"test accuracy ([\d.]+)", last_line(result))
    assert match, result.stdout
    first, last, test_accuracy = float(match[1]), float(match[2]), float(match[4])
    assert last < 0.5 * first and test_accuracy > 0.85  # three classes: chance is 1/3
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    losses = {row["step"]: row["loss"] for row in rows if "loss" in row}
    assert sorted(losses) == [1, *range(10, 151, 10)]  # step 1, then every 10 steps
    assert losses[140] < 0.5 * losses[1]
    assert "loss = " in result.stderr  # LoggingHook's lines


@pytest.mark.slow
def test_char_lm_learns_below_the_unigram_entropy_and_writes_text(tmp_path):
    result = run_example("char_lm.py", "--steps", "120", "--workdir", str(tmp_path))
    match = re.fullmatch(r"validation loss ([\d.]+) -> ([\d.]+) nats/char \(unigram entropy ([\d.]+), "
                         r"[\d.]+ perplexity\) after 120 steps", last_line(result))
    assert match, result.stdout
    start, final, entropy = float(match[1]), float(match[2]), float(match[3])
    assert 2.0 < entropy < 4.5 and final < entropy - 0.3 and final < start - 2.0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert [entry["step"] for entry in summary["history"]] == [0, 30, 60, 90, 120]
    assert summary["eval_compilations"] == 1
    losses = [entry["loss"] for entry in summary["history"]]
    assert losses == sorted(losses, reverse=True)
    # The EvalHook's values went to metrics.jsonl beside the training summaries: the
    # token-weighted train loss and its perplexity, every 6 steps and at step 1.
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows if "eval/loss" in row] == [0, 30, 60, 90, 120]
    train = [row for row in rows if "train/loss" in row]
    assert [row["step"] for row in train] == [1, *range(6, 121, 6)]
    assert all(row["train/perplexity"] == pytest.approx(np.exp(row["train/loss"]), rel=1e-6) for row in train)
    # The evaluation at step 0 is Σ loss / Σ tokens over the same batches (the last one
    # padded and masked), not a mean of the batches' own means.
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        import char_lm
    finally:
        sys.path.remove(str(ROOT / "examples"))
    data = char_lm.load_data(64, 16, 8)
    state = char_lm.make_init_fn(char_lm.CharTransformer(len(data.chars), 64), 64)()
    next_char_sums = jax.jit(char_lm.next_char_sums, static_argnums=0)
    sums = [jax.device_get(next_char_sums(state.apply_fn, state.params, b["tokens"], b["mask"]))
            for b in data.val_batches]
    total = sum(np.float64(s) for s, _ in sums) / sum(np.float64(t) for _, t in sums)
    assert len({float(t) for _, t in sums}) == 2  # unequal token counts
    assert summary["history"][0]["loss"] == pytest.approx(total, rel=1e-6)
    assert abs(np.mean([s / t for s, t in sums]) - total) > 1e-3
    assert summary["history"][0]["perplexity"] == pytest.approx(np.exp(total), rel=1e-6)
    sample = re.search(r"--- sample ---\n(.*)\n--- end ---", result.stdout, re.DOTALL)
    assert sample, result.stdout
    assert sample[1] == summary["sample"] and sample[1].startswith("    def ") and len(sample[1]) == 108


@pytest.mark.processes
@pytest.mark.slow
def test_data_parallel_example_trains_as_two_processes_that_agree(tmp_path):
    result = warm_processes.run([sys.executable, str(ROOT / "examples" / "data_parallel.py"), "--launch", "2",
                                 "--steps", "120", "--workdir", str(tmp_path)],
                                capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    finals = sorted(re.findall(r"process (\d)/2, 2 devices: step (\d+), test accuracy ([\d.]+)", result.stdout))
    assert [f[0] for f in finals] == ["0", "1"] and {f[1] for f in finals} == {"120"}
    assert finals[0][2] == finals[1][2] and float(finals[0][2]) > 0.85  # one replicated model
    assert jm.latest_checkpoint_step(tmp_path) == 120
    assert len(list(tmp_path.glob("events.out.tfevents.*"))) == 1  # the chief's alone
    assert "[process 0/2] Saving checkpoint 120" in result.stderr  # log lines name their process


def test_data_parallel_example_on_eight_simulated_devices(tmp_path):
    result = warm_processes.run([sys.executable, str(ROOT / "examples" / "data_parallel.py"), "--steps", "60",
                                 "--workdir", str(tmp_path)], capture_output=True, text=True, timeout=240, cwd=ROOT,
                                env=cpu_env(devices=8))
    assert result.returncode == 0, result.stderr[-3000:]
    assert re.search(r"process 0/1, 8 devices: step 60, test accuracy 0\.[89]", result.stdout), result.stdout


def _ptb_example():
    """examples/ptb_lstm.py as a module (its model, data and port)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("ptb_lstm", ROOT / "examples" / "ptb_lstm.py")
    module = sys.modules["ptb_lstm"] = importlib.util.module_from_spec(spec)  # flax resolves its names there
    spec.loader.exec_module(module)
    return module


PTB_ARGS = ("--vocab", "200", "--hidden", "16", "--batch-size", "4", "--num-steps", "5", "--words", "300",
            "--max-epoch", "1", "--max-max-epoch", "2")


def _tf_run_epochs(ptb, epochs):
    """TF's `ptb_word_lm.main` as a plain loop: each epoch assigns its learning rate and
    starts the LSTM from zeros, every batch's final state feeds the next; returns every
    step's cost, and after each epoch the validation cost over the split (its state
    carried across the batches) and, after the last (as TF runs it), the test cost (batch
    1, one word per run; None after the others)."""
    import optax

    train, valid, test = (split[:300] for split in ptb.word_ids(200))
    model = ptb.PTBModel(200, 16)
    epoch, valid_batches, test_batches = ptb.batches(train, 4, 5), ptb.batches(valid, 4, 5), ptb.batches(test, 1, 1)
    params = jax.jit(model.init)(jax.random.key(0), ptb.zero_state(model, 4), epoch[0]["x"])["params"]

    def tx(lr):  # clipped SGD at the epoch's learning rate
        return optax.chain(optax.clip_by_global_norm(5.0), optax.sgd(lr))

    opt_state = tx(1.0).init(params)
    grad = jax.jit(jax.value_and_grad(ptb.lm_cost, has_aux=True), static_argnums=1)
    cost_of = jax.jit(ptb.lm_cost, static_argnums=1)

    @jax.jit
    def apply(grads, opt_state, params, lr):
        updates, opt_state = tx(lr).update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    def split_cost(batches, batch_size):
        carry, costs = ptb.zero_state(model, batch_size), []
        for batch in batches:
            cost, carry = cost_of(params, model.apply, carry, batch)
            costs.append(float(cost))
        return costs

    costs, evaluations = [], []
    for i in range(epochs):
        lr = 1.0 * 0.5 ** max(i + 1 - 1, 0)  # assign_lr
        carry = ptb.zero_state(model, 4)  # run_epoch: state = session.run(model.initial_state)
        for batch in epoch:
            (cost, carry), grads = grad(params, model.apply, carry, batch)
            params, opt_state = apply(grads, opt_state, params, lr)
            costs.append(float(cost))
        evaluations.append((split_cost(valid_batches, 4), split_cost(test_batches, 1) if i == epochs - 1 else None))
    return costs, evaluations, len(epoch)


def _records(workdir):
    with open(workdir / "metrics.jsonl") as f:
        return [json.loads(line) for line in f]


def test_the_ptb_port_reports_tfs_per_epoch_perplexities_and_resumes_mid_epoch_as_one_run(tmp_path):
    ptb = _ptb_example()
    source = (ROOT / "examples" / "ptb_lstm.py").read_text()
    port = source.split("# -- the port")[1].split("# -- end of the port")[0].splitlines()[1:]
    assert len([line for line in port if line.strip() and not line.strip().startswith("#")]) < 40

    result = run_example("ptb_lstm.py", *PTB_ARGS, "--workdir", str(tmp_path / "whole"))
    costs, evaluations, epoch_size = _tf_run_epochs(ptb, 2)
    assert epoch_size == 14  # 300 words in 4 rows of 75: (75 - 1) // 5 batches
    records = _records(tmp_path / "whole")
    train = {r["step"]: r["train/perplexity"] for r in records if "train/perplexity" in r}
    # Epoch 1 is steps 1..14 (the record after step 1, the starting point, ends no window), epoch 2 steps 15..28;
    # every step's iters is num_steps = 5.
    assert sorted(train) == [1, 14, 28]
    assert train[1] == pytest.approx(np.exp(costs[0] / 5), rel=1e-5)
    assert train[14] == pytest.approx(np.exp(sum(costs[:14]) / (14 * 5)), rel=1e-4)
    assert train[28] == pytest.approx(np.exp(sum(costs[14:]) / (14 * 5)), rel=1e-4)
    valid = {r["step"]: r["valid/perplexity"] for r in records if "valid/perplexity" in r}
    test = {r["step"]: r["test/perplexity"] for r in records if "test/perplexity" in r}
    for (valid_costs, _), step in zip(evaluations, (14, 28), strict=True):
        assert valid[step] == pytest.approx(np.exp(sum(valid_costs) / (5 * len(valid_costs))), rel=1e-4)
    assert list(test) == [28]  # the one-off test run: the final state, batch 1 of 1 word
    assert test[28] == pytest.approx(np.exp(sum(evaluations[-1][1]) / len(evaluations[-1][1])), rel=1e-4)
    assert last_line(result) == f"test perplexity {test[28]:.2f}"
    assert re.search(r"step 14: train perplexity = [\d.]+ \(", result.stderr)
    # Every scalar output is a summary of the session's own writer: only `cost` (`iters` is computed by the reduction).
    assert not any("iters" in r for r in records)

    # Stopped mid-epoch 2 and run again: the LSTM state and the data position come back with the checkpoint.
    run_example("ptb_lstm.py", *PTB_ARGS, "--workdir", str(tmp_path / "resumed"), "--last-step", "20")
    assert jm.latest_checkpoint_step(tmp_path / "resumed") == 20
    run_example("ptb_lstm.py", *PTB_ARGS, "--workdir", str(tmp_path / "resumed"))
    resumed = _records(tmp_path / "resumed")
    # Bit for bit: the same records, and the stopped run's own evaluations at its end (step 20).
    for tag, whole in (("train/perplexity", train), ("valid/perplexity", valid), ("test/perplexity", test)):
        written = {r["step"]: r[tag] for r in resumed if tag in r}
        evaluated_at_stop = [] if tag == "train/perplexity" else [20]  # the stopped run's final state
        assert sorted(written) == sorted([*whole, *evaluated_at_stop]), tag
        assert {step: written[step] for step in whole} == whole, tag
