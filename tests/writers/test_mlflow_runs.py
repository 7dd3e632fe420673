"""`jm.MlflowWriter`: what a training session and `jaxmon train` write reaches one MLflow run
(a local file store, read back with MLflow's client), the same run across a SIGKILL and
the resume; a process that is not the chief writes nothing."""

import json
import signal
import subprocess
import sys

import jax.numpy as jnp
import pytest
from helpers import ROOT, cpu_env, kill_once_checkpointed, tracked_config

import jaxmon as jm

mlflow = pytest.importorskip("mlflow")


@pytest.fixture
def store(tmp_path, monkeypatch):
    """A local MLflow store (MLflow 3 wants this variable for one)."""
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    return (tmp_path / "mlruns").as_uri()


def count_step(state, batch):
    return state + 1.0, {"value": state + 1.0}


def test_a_training_session_writes_its_scalars_hparams_and_config_into_one_mlflow_run(tmp_path, store):
    writer = jm.MlflowWriter(tmp_path, tracking_uri=store, experiment="unit")
    with jm.MonitoredTrainingSession(count_step, lambda: jnp.zeros(()), checkpoint_dir=tmp_path,
                                     save_summaries_steps=5, writers=[writer], config={"lr": 0.1},
                                     hparams={"model": {"width": 8}}, hooks=[jm.StopAtStepHook(last_step=10)]) as sess:
        while not sess.should_stop():
            sess.run()
    client = mlflow.tracking.MlflowClient(store)
    run = client.get_run(json.loads((tmp_path / "mlflow_run.json").read_text())["run_id"])
    assert run.info.status == "FINISHED" and run.info.run_name == tmp_path.name
    history = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "value")}
    jsonl = {r["step"]: r["value"] for r in map(json.loads, (tmp_path / "metrics.jsonl").read_text().splitlines())
             if "value" in r}
    assert history == jsonl and {5, 10} <= set(history)  # what metrics.jsonl holds, at its steps
    assert run.data.params == {"model.width": "8"}
    text = client.download_artifacts(run.info.run_id, "text/config/step_0.txt", str(tmp_path / "art"))
    assert json.loads(open(text).read()) == {"lr": 0.1}


def test_a_process_that_is_not_the_chief_creates_no_mlflow_run(tmp_path, store):
    writer = jm.MlflowWriter(tmp_path, tracking_uri=store, experiment="unit")
    with jm.MonitoredTrainingSession(count_step, lambda: jnp.zeros(()), checkpoint_dir=tmp_path, is_chief=False,
                                     writers=[writer], hooks=[jm.StopAtStepHook(last_step=3)]) as sess:
        while not sess.should_stop():
            sess.run()
    assert writer.run_id is None and not (tmp_path / "mlflow_run.json").exists()
    assert mlflow.tracking.MlflowClient(store).get_experiment_by_name("unit") is None


@pytest.mark.slow
def test_jaxmon_train_killed_and_resumed_writes_one_mlflow_run(tmp_path, store):
    config = tracked_config(tmp_path, {"name": "mlflow", "tracking_uri": store, "experiment": "tiny"})
    command = [sys.executable, "-m", "jaxmon", "train", "--config", str(config), "--workdir", str(tmp_path / "run")]
    env = {**cpu_env(), "MLFLOW_ALLOW_FILE_STORE": "true"}
    code, _, _ = kill_once_checkpointed(command, tmp_path / "run", 20, env=env)
    assert code == -signal.SIGKILL
    rerun = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    client = mlflow.tracking.MlflowClient(store)
    experiment = client.get_experiment_by_name("tiny")
    runs = client.search_runs([experiment.experiment_id])
    assert len(runs) == 1 and runs[0].info.status == "FINISHED"  # one tracker run across the kill
    run_id = runs[0].info.run_id
    assert {m.step for m in client.get_metric_history(run_id, "eval/accuracy")} == {25, 50}
    assert max(m.step for m in client.get_metric_history(run_id, "loss")) == 50
    assert runs[0].data.params["optimizer.name"] == "adam" and runs[0].data.params["steps"] == "50"
    text = client.download_artifacts(run_id, "text/config/step_0.txt", str(tmp_path / "art"))
    assert json.loads(open(text).read())["steps"] == 50
