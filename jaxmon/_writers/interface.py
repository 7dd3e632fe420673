"""The summary writer protocol: what summary-writing hooks need of a writer."""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

import numpy as np


@runtime_checkable
class SummaryWriter(Protocol):
    """What summary-writing hooks need of a writer; values are host NumPy or Python."""

    def write_scalars(self, step: int, scalars: Mapping[str, float]) -> None: ...
    def write_histograms(self, step: int, arrays: Mapping[str, np.ndarray]) -> None: ...
    def write_images(self, step: int, images: Mapping[str, np.ndarray]) -> None: ...
    def write_texts(self, step: int, texts: Mapping[str, str]) -> None: ...
    def write_hparams(self, hparams: Mapping[str, Any]) -> None: ...
    def flush(self) -> None: ...
    def close(self) -> None: ...


class NoArrays:
    """For a writer that keeps scalars and texts only (metrics.jsonl, MLflow, W&B):
    histograms and images are not written there."""

    def write_histograms(self, step: int, arrays: Mapping[str, np.ndarray]) -> None:
        del step, arrays

    def write_images(self, step: int, images: Mapping[str, np.ndarray]) -> None:
        del step, images


def restart(writer: Any, step: int) -> None:
    """`writer.restart(step)` for a writer that has it (a user's writer may not)."""
    method = getattr(writer, "restart", None)
    if callable(method):
        method(step)


def installed(package: str) -> bool:
    """Whether `package` can be imported, found without importing it (a tracker's
    package is checked before a run; importing W&B or MLflow takes seconds)."""
    try:
        return importlib.util.find_spec(package) is not None
    except (ImportError, ValueError):  # a parent that fails, or a module set to None in sys.modules
        return False
