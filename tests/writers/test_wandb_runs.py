"""`jm.WandbWriter`: what a training session and `jaxmon train` write reaches one W&B run,
in W&B's offline mode (no network), read back from the run's transaction log; the same
run across a SIGKILL and the resume; a process that is not the chief starts none."""

import glob
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax.numpy as jnp
import pytest
from helpers import ROOT, cpu_env, kill_once_checkpointed, tracked_config

import jaxmon as jm

wandb_pb = pytest.importorskip("wandb.proto.wandb_internal_pb2")


def transaction_log(path: str) -> list[bytes]:
    """The records of a W&B run file (`run-<id>.wandb`): a 7-byte header, then LevelDB's log
    format, blocks of 32 KiB of records with a 7-byte header each (a record cut at a block's
    end continues in the next: FIRST, MIDDLE, LAST)."""
    data, pos, out, pending = Path(path).read_bytes(), 7, [], b""
    assert data[:4] == b":W&B", data[:7]
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        if left < 7 or kind == 0:  # a block's padding
            pos += left
            continue
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind == 1:
            out.append(chunk)
        elif kind == 2:
            pending = chunk
        else:
            pending += chunk
            if kind == 4:
                out.append(pending)
                pending = b""
    return out


def offline_runs(logdir: Path) -> list[dict]:
    """Each offline W&B run under `logdir/wandb`: its id, history (`{step: {key: value}}`) and config."""
    runs = []
    for path in sorted(glob.glob(str(logdir / "wandb" / "offline-run-*" / "run-*.wandb"))):
        run = {"id": None, "history": {}, "config": {}, "dir": os.path.dirname(path)}
        for raw in transaction_log(path):
            record = wandb_pb.Record()
            record.ParseFromString(raw)
            kind = record.WhichOneof("record_type")
            if kind == "run":
                run["id"] = record.run.run_id
                run["config"] |= {item.key: json.loads(item.value_json) for item in record.run.config.update}
            elif kind == "config":
                run["config"] |= {item.key or "/".join(item.nested_key): json.loads(item.value_json)
                                  for item in record.config.update}
            elif kind == "history":
                values = {"/".join(item.nested_key) or item.key: json.loads(item.value_json)
                          for item in record.history.item}
                run["history"][values["_step"]] = {k: v for k, v in values.items() if not k.startswith("_")}
        runs.append(run)
    return runs


def count_step(state, batch):
    return state + 1.0, {"value": state + 1.0}


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")


def test_a_training_session_writes_its_scalars_hparams_and_config_into_one_wandb_run(tmp_path):
    writer = jm.WandbWriter(tmp_path, project="unit")
    with jm.MonitoredTrainingSession(count_step, lambda: jnp.zeros(()), checkpoint_dir=tmp_path,
                                     save_summaries_steps=5, writers=[writer], config={"lr": 0.1},
                                     hparams={"model": {"width": 8}}, hooks=[jm.StopAtStepHook(last_step=10)]) as sess:
        while not sess.should_stop():
            sess.run()
    run_id = json.loads((tmp_path / "wandb_run.json").read_text())["run_id"]
    deadline = time.monotonic() + 20  # W&B's own process may still be writing what `finish()` handed it
    while (run := offline_runs(tmp_path)[0])["id"] != run_id or not run["history"]:
        assert time.monotonic() < deadline, run
        time.sleep(0.2)
    jsonl = {r["step"]: r["value"] for r in map(json.loads, (tmp_path / "metrics.jsonl").read_text().splitlines())
             if "value" in r}
    assert {step: values["value"] for step, values in run["history"].items() if "value" in values} == jsonl
    assert run["config"]["model.width"] == 8
    text = Path(run["dir"], "files", "text", "config", "step_0.txt").read_text()
    assert json.loads(text) == {"lr": 0.1}


def test_a_process_that_is_not_the_chief_starts_no_wandb_run(tmp_path):
    writer = jm.WandbWriter(tmp_path, project="unit")
    with jm.MonitoredTrainingSession(count_step, lambda: jnp.zeros(()), checkpoint_dir=tmp_path, is_chief=False,
                                     writers=[writer], hooks=[jm.StopAtStepHook(last_step=3)]) as sess:
        while not sess.should_stop():
            sess.run()
    assert not (tmp_path / "wandb_run.json").exists() and not (tmp_path / "wandb").exists()


def _train_command(tmp_path: Path) -> tuple[list[str], dict[str, str]]:
    config = tracked_config(tmp_path, {"name": "wandb", "project": "tiny", "mode": "offline"})
    command = [sys.executable, "-m", "jaxmon", "train", "--config", str(config), "--workdir", str(tmp_path / "run")]
    # Not this process's W&B service (its address is in WANDB_SERVICE once a test here used W&B): each
    # command starts its own, as a fresh shell's would; W&B's own quiet is jaxmon train's to set.
    return command, {k: v for k, v in cpu_env().items() if k not in ("WANDB_SERVICE", "WANDB_SILENT")}


@pytest.mark.slow
def test_jaxmon_train_writes_its_scalars_hyper_parameters_and_config_into_a_wandb_run(tmp_path):
    command, env = _train_command(tmp_path)
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    said = [line for line in (done.stdout + done.stderr).splitlines() if line.lower().startswith("wandb")]
    assert said == [], said  # W&B's own lines with --debug only
    [run] = offline_runs(tmp_path / "run")
    assert {step for step, values in run["history"].items() if "eval/accuracy" in values} == {25, 50}
    assert {step for step, values in run["history"].items() if "loss" in values} >= {10, 20, 30, 40, 50}
    assert run["config"]["optimizer.name"] == "adam" and run["config"]["steps"] == 50
    assert json.loads(Path(run["dir"], "files", "text", "config", "step_0.txt").read_text())["steps"] == 50


@pytest.mark.slow
def test_jaxmon_train_killed_and_resumed_goes_on_with_one_wandb_run(tmp_path):
    command, env = _train_command(tmp_path)
    workdir = tmp_path / "run"
    code, _, _ = kill_once_checkpointed(command, workdir, 20, env=env)
    assert code == -signal.SIGKILL
    rerun = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    run_id = json.loads((workdir / "wandb_run.json").read_text())["run_id"]
    runs = offline_runs(workdir)  # one directory per process: the killed one's, the rerun's
    assert len(runs) == 2 and all(run["dir"].endswith(f"-{run_id}") for run in runs)  # one W&B run, resumed
    resumed = runs[-1]  # (the killed process's W&B core died with it, before writing what it was given)
    assert resumed["id"] == run_id
    assert {step for step, values in resumed["history"].items() if "eval/accuracy" in values} == {25, 50}
    assert max(step for step, values in resumed["history"].items() if "loss" in values) == 50
