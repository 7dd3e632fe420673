"""The `writers` section, checked before a run: a tracker whose package is missing, or an
MLflow file store that MLflow refuses, ends `jaxmon train` and `jaxmon check` with one
line (exit 2) before JAX loads, and nothing is written."""

import subprocess
import sys
import time

import pytest
from helpers import ROOT, cpu_env, tracked_config

import jaxmon as jm
from jaxmon._experiment.trackers import writers_of


def without(package, directory):
    """An environment whose Python cannot import `package` (a sitecustomize sets it to
    None in sys.modules, as an uninstalled package reads)."""
    directory.mkdir()
    (directory / "sitecustomize.py").write_text(f"import sys\nsys.modules[{package!r}] = None\n")
    env = cpu_env()
    env["PYTHONPATH"] = f"{directory}:{env.get('PYTHONPATH', '')}"
    return env


def command(name, config, workdir):
    return [sys.executable, "-X", "importtime", "-m", "jaxmon", name, "--config", str(config),
            *(["--workdir", str(workdir)] if name == "train" else [])]


def fails_at_once(name, config, workdir, env, *words):
    """Runs `jaxmon NAME`: exit 2 in under 2 s, before JAX loads, with one line naming `words`."""
    start = time.monotonic()
    result = subprocess.run(command(name, config, workdir), cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=60)
    took = time.monotonic() - start
    lines = result.stderr.splitlines()
    imported = [line.rpartition("|")[2].strip() for line in lines if line.startswith("import time")]
    said = [line for line in lines if not line.startswith("import time")]
    assert result.returncode == 2, result.stderr[-3000:]
    assert len(said) == 1 and said[0].startswith(f"jaxmon {name}: ") and "Traceback" not in result.stderr, said
    for word in words:
        assert word in said[0], (word, said[0])
    assert "jax" not in imported and took < 2.0, took  # said before JAX loads
    assert not workdir.exists()


@pytest.mark.parametrize("writer, package, words", [
    ({"name": "wandb", "project": "tiny", "mode": "offline"}, "wandb",
     ["writers.0 (wandb): WandbWriter needs W&B, which is not installed: pip install 'jaxmon[wandb]'."]),
    ({"name": "mlflow", "experiment": "tiny"}, "mlflow",
     ["writers.0 (mlflow): MlflowWriter needs MLflow, which is not installed: pip install 'jaxmon[mlflow]'."]),
], ids=["wandb", "mlflow"])
@pytest.mark.parametrize("name", ["train", "check"])
def test_a_tracker_whose_package_is_missing_is_one_line_before_jax_loads(tmp_path, writer, package, words, name):
    config = tracked_config(tmp_path, writer)
    fails_at_once(name, config, tmp_path / "run", without(package, tmp_path / "site"), *words)


@pytest.mark.parametrize("name", ["train", "check"])
def test_an_mlflow_file_store_without_its_switch_is_one_line_naming_both_fixes(tmp_path, name):
    store = (tmp_path / "mlruns").as_uri()
    config = tracked_config(tmp_path, {"name": "mlflow", "tracking_uri": store, "experiment": "tiny"})
    env = {key: value for key, value in cpu_env().items() if key != "MLFLOW_ALLOW_FILE_STORE"}
    fails_at_once(name, config, tmp_path / "run", env, f"writers.0 (mlflow): tracking_uri {store!r} is a file store",
                  "MLFLOW_ALLOW_FILE_STORE=true", "sqlite:///")
    assert not (tmp_path / "mlruns").exists()


def test_the_check_passes_a_database_a_server_a_switched_file_store_and_no_uri(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    for uri in (f"sqlite:///{tmp_path}/mlflow.db", "http://127.0.0.1:5000", "databricks", None):
        assert len(writers_of([{"name": "mlflow", "tracking_uri": uri}], str(tmp_path))) == 1
    with pytest.raises(jm.ConfigError, match="is a file store"):
        writers_of([{"name": "mlflow", "tracking_uri": str(tmp_path / "mlruns")}], str(tmp_path))  # a plain path
    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "mlruns").as_uri())  # the default, from MLflow's variable
    with pytest.raises(jm.ConfigError, match="is a file store"):
        writers_of([{"name": "mlflow"}], str(tmp_path))
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    assert len(writers_of([{"name": "mlflow"}], str(tmp_path))) == 1
    assert not (tmp_path / "mlruns").exists()  # checking writes nothing
