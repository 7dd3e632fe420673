"""WandbWriter: a run's summaries in one Weights & Biases run, the same one across restarts."""

from __future__ import annotations

import json
import os
import secrets
from collections.abc import Mapping
from typing import Any

import numpy as np

from jaxmon._base.errors import ConfigError
from jaxmon._base.paths import open_file
from jaxmon._writers.hparams import flat_hparams
from jaxmon._writers.interface import NoArrays, installed

#: Where a run's directory keeps the id of its W&B run.
RUN_FILE = "wandb_run.json"


class WandbWriter(NoArrays):
    """Writes summaries into a Weights & Biases run: scalars at their step (`run.log`),
    hyper-parameters into its config (flattened: `model.width`), text as files of the run
    (`text/<tag>/step_<step>.txt`); histograms and images are left to TensorBoard.

    The W&B run starts at the first write (a process that never writes, such as a
    non-chief one, starts none), in `logdir/wandb`, and its id is kept in
    `logdir/wandb_run.json`: a run resumed in the same directory goes on with the same
    W&B run (`resume="allow"`). W&B keeps a run's steps increasing, so the steps a killed
    run wrote after its last checkpoint are the ones it shows; `mode="offline"` writes
    the run to disk for a later `wandb sync`.

    Args:
      logdir: the run's directory (the W&B run's files and its id go there).
      project: the W&B project.
      entity: the W&B entity (team or user); None: the default.
      run_name: the W&B run's name (default: the name of `logdir`).
      mode: "online", "offline" or "disabled"; None: W&B's default (`$WANDB_MODE`).

    Example:
      >>> import jaxmon as jm
      >>> writer = jm.WandbWriter("runs/lm", project="lm", mode="offline")
    """

    def __init__(self, logdir: str | os.PathLike, *, project: str = "jaxmon", entity: str | None = None,
                 run_name: str | None = None, mode: str | None = None):
        self.logdir, self.project, self.entity, self.mode = os.fspath(logdir), project, entity, mode
        self.run_name = run_name or os.path.basename(os.path.abspath(self.logdir))
        self._run: Any = None

    def check(self) -> None:
        """Raises a `ConfigError` when W&B is not installed: before a run, not at its first write."""
        if not installed("wandb"):
            raise ConfigError("WandbWriter needs W&B, which is not installed: pip install 'jaxmon[wandb]'.")

    @property
    def run(self) -> Any:
        """The W&B run: this directory's, or a new one."""
        if self._run is None:
            try:
                import wandb
            except ImportError:
                raise ImportError("WandbWriter needs W&B: pip install 'jaxmon[wandb]'.") from None
            path = os.path.join(self.logdir, RUN_FILE)
            if os.path.isfile(path):
                with open(path, encoding="utf-8") as f:
                    run_id = json.load(f)["run_id"]
            else:
                run_id = secrets.token_hex(4)  # W&B's ids: letters and digits
                os.makedirs(self.logdir, exist_ok=True)
                with open_file(path, "w", encoding="utf-8") as f:
                    json.dump({"run_id": run_id, "project": self.project}, f)
            self._run = wandb.init(project=self.project, entity=self.entity, name=self.run_name, id=run_id,
                                   resume="allow", dir=self.logdir, mode=self.mode)
        return self._run

    def write_scalars(self, step: int, scalars: Mapping[str, float]) -> None:
        self.run.log({tag: float(np.asarray(value)) for tag, value in scalars.items()}, step=int(step))

    def write_texts(self, step: int, texts: Mapping[str, str]) -> None:
        for tag, text in texts.items():
            path = os.path.join(self.run.dir, "text", *tag.split("/"), f"step_{step}.txt")
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open_file(path, "w", encoding="utf-8") as f:
                f.write(str(text))

    def write_hparams(self, hparams: Mapping[str, Any]) -> None:
        self.run.config.update(flat_hparams(hparams), allow_val_change=True)

    def flush(self) -> None:
        pass  # W&B's own process sends what the run logged

    def close(self) -> None:
        if self._run is not None:
            self._run.finish()
            self._run = None

    def __repr__(self) -> str:
        return f"WandbWriter({self.logdir!r}, project={self.project!r})"
