"""MlflowWriter: a run's summaries in one MLflow run, the same one across restarts."""

from __future__ import annotations

import importlib.metadata
import json
import os
import time
import urllib.parse
from collections.abc import Mapping
from typing import Any

import numpy as np

from jaxmon._base.errors import ConfigError
from jaxmon._base.paths import open_file
from jaxmon._writers.hparams import flat_hparams
from jaxmon._writers.interface import NoArrays, installed

#: Where a run's directory keeps the id of its MLflow run.
RUN_FILE = "mlflow_run.json"
_PARAM_CHARS = 6000  # MLflow's longest param value


class MlflowWriter(NoArrays):
    """Writes summaries into an MLflow run: scalars as metrics at their step,
    hyper-parameters as params (flattened: `model.width`), text as artifacts
    `text/<tag>/step_<step>.txt`; histograms and images are left to TensorBoard.

    The MLflow run is created at the first write (a process that never writes, such as
    a non-chief one, creates none) and its id kept in `logdir/mlflow_run.json`: a run
    resumed in the same directory writes on into the same MLflow run, marked running
    again, and finished at `close()`. MLflow cannot drop points: the steps a killed run
    wrote after its last checkpoint are in it twice.

    Args:
      logdir: the run's directory (where the MLflow run's id is kept).
      tracking_uri: MLflow's tracking URI (a server, `databricks`, or a local store);
        None: MLflow's default (`$MLFLOW_TRACKING_URI`).
      experiment: the MLflow experiment's name (created if missing).
      run_name: the MLflow run's name (default: the name of `logdir`).

    Example:
      >>> import jaxmon as jm
      >>> writer = jm.MlflowWriter("runs/lm", tracking_uri="http://localhost:5000", experiment="lm")
    """

    def __init__(self, logdir: str | os.PathLike, *, tracking_uri: str | None = None, experiment: str = "jaxmon",
                 run_name: str | None = None):
        self.logdir, self.tracking_uri, self.experiment = os.fspath(logdir), tracking_uri, experiment
        self.run_name = run_name or os.path.basename(os.path.abspath(self.logdir))
        self._client: Any = None
        self.run_id: str | None = None

    def check(self) -> None:
        """Raises a `ConfigError` (one line, the fix in it) when MLflow is not installed or
        the tracking URI is a file store that MLflow refuses: before a run, not at its first
        write."""
        if not installed("mlflow"):
            raise ConfigError("MlflowWriter needs MLflow, which is not installed: pip install 'jaxmon[mlflow]'.")
        uri = self.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
        if not uri or not _file_store(uri) or os.environ.get("MLFLOW_ALLOW_FILE_STORE", "").lower() == "true":
            return
        version = _version()
        if _refuses_file_stores(version):
            raise ConfigError(
                f"tracking_uri {uri!r} is a file store, which MLflow {version} refuses unless "
                "MLFLOW_ALLOW_FILE_STORE=true is set: set it, or track into a database such as "
                f"'sqlite:///{os.path.abspath(self.logdir)}/mlflow.db'.")

    def _run(self) -> tuple[Any, str]:
        """The client and the MLflow run's id: this directory's run, or a new one."""
        if self._client is None:
            try:
                from mlflow.tracking import MlflowClient
            except ImportError:
                raise ImportError("MlflowWriter needs MLflow: pip install 'jaxmon[mlflow]'.") from None
            self._client = MlflowClient(self.tracking_uri)
            path = os.path.join(self.logdir, RUN_FILE)
            if os.path.isfile(path):
                with open(path, encoding="utf-8") as f:
                    self.run_id = json.load(f)["run_id"]
                self._client.update_run(self.run_id, status="RUNNING")
            else:
                found = self._client.get_experiment_by_name(self.experiment)
                experiment_id = found.experiment_id if found else self._client.create_experiment(self.experiment)
                self.run_id = self._client.create_run(experiment_id, run_name=self.run_name).info.run_id
                os.makedirs(self.logdir, exist_ok=True)
                with open_file(path, "w", encoding="utf-8") as f:
                    json.dump({"run_id": self.run_id, "tracking_uri": self.tracking_uri}, f)
        return self._client, self.run_id

    def write_scalars(self, step: int, scalars: Mapping[str, float]) -> None:
        from mlflow.entities import Metric

        client, run_id = self._run()
        now = int(time.time() * 1000)
        client.log_batch(run_id, metrics=[Metric(tag, float(np.asarray(value)), now, int(step))
                                          for tag, value in scalars.items()])

    def write_texts(self, step: int, texts: Mapping[str, str]) -> None:
        client, run_id = self._run()
        for tag, text in texts.items():
            client.log_text(run_id, str(text), f"text/{tag}/step_{step}.txt")

    def write_hparams(self, hparams: Mapping[str, Any]) -> None:
        from mlflow.entities import Param

        client, run_id = self._run()
        params = [Param(key, str(value)[:_PARAM_CHARS]) for key, value in flat_hparams(hparams).items()]
        for start in range(0, len(params), 100):  # MLflow takes at most 100 params a batch
            client.log_batch(run_id, params=params[start:start + 100])

    def flush(self) -> None:
        pass  # every write is sent as it comes

    def close(self) -> None:
        if self.run_id is not None:
            self._client.set_terminated(self.run_id, "FINISHED")

    def __repr__(self) -> str:
        return f"MlflowWriter({self.logdir!r}, experiment={self.experiment!r})"


def _file_store(uri: str) -> bool:
    """Whether a tracking URI names MLflow's file store (a `file:` URI or a plain path)."""
    scheme = urllib.parse.urlparse(uri).scheme
    return scheme == "file" or (scheme == "" and uri != "databricks") or (len(scheme) == 1 and os.name == "nt")


def _version() -> str:
    """The installed MLflow's version (its full package's or mlflow-skinny's), read
    without importing it; "3.13" (the first to refuse file stores) when neither says."""
    for distribution in ("mlflow", "mlflow-skinny"):
        try:
            return importlib.metadata.version(distribution)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "3.13"


def _refuses_file_stores(version: str) -> bool:
    """Whether this MLflow refuses a file store without MLFLOW_ALLOW_FILE_STORE (3.13 on)."""
    parts = [int(part) if part.isdigit() else 0 for part in version.split(".")[:2]]
    return tuple(parts + [0] * (2 - len(parts))) >= (3, 13)
