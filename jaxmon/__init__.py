"""jaxmon: TF 1.x's MonitoredSession and hooks, re-made for JAX.

Every public name loads with its module on first use (PEP 562): `jaxmon --help`, a
config's error and `jaxmon inspect` answer without loading JAX, and a program that
uses a few names loads only what they need. The imports below are the names' one list,
read by type checkers; `_SUBMODULES` and `_PUBLIC` below are the same list as plain
code, which `__getattr__` reads (tests/test_architecture.py keeps the two equal).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# First, before JAX loads: in the `jaxmon` command, Ctrl-C and SIGTERM are handled from here on.
from jaxmon._base import signals as _signals  # noqa: F401  isort: skip

if TYPE_CHECKING:
    from jaxmon import datasets, distributed, hooks, models
    from jaxmon._base.errors import AbortedError, ConfigError, NanLossDuringTrainingError, UnavailableError
    from jaxmon._base.hook import (
        Hook,
        RunArgs,
        RunContext,
        RunValues,
        SessionRunArgs,
        SessionRunContext,
        SessionRunHook,
        SessionRunValues,
    )
    from jaxmon._base.triggers import NeverTriggerTimer, SecondOrStepTimer, Trigger
    from jaxmon._checkpoints.manager import Restored, checkpoints_iterator, restore_checkpoint
    from jaxmon._checkpoints.warm_start import WarmStartReport
    from jaxmon._data.arrays import ArrayDataSource
    from jaxmon._data.loaders import ResumableIterator
    from jaxmon._experiment.config_file import apply_overrides, load_config
    from jaxmon._experiment.tasks import Task, TaskContext
    from jaxmon._experiment.train import train_experiment
    from jaxmon._metrics.reductions import FirstNonFinite, Last, Mean, Ratio, Reduction, Sum
    from jaxmon._ops.host_syncs import HostSyncError
    from jaxmon._processes.agree import PeerError
    from jaxmon._run.session import MonitoredSession
    from jaxmon._run.train_state import TrainState
    from jaxmon._run.training import USE_DEFAULT, MonitoredTrainingSession
    from jaxmon._writers import (
        JsonlWriter,
        MlflowWriter,
        MultiWriter,
        SummaryWriter,
        SummaryWriterCache,
        TensorBoardWriter,
        WandbWriter,
    )
    from jaxmon.hooks import (
        CheckpointSaverHook,
        CheckpointSaverListener,
        EarlyStoppingHook,
        EvalHook,
        FeedFnHook,
        FinalOpsHook,
        GlobalStepWaiterHook,
        GoodputHook,
        Histogram,
        Image,
        LoggingHook,
        LoggingTensorHook,
        NanHook,
        NanTensorHook,
        PeriodicHook,
        ProfilerHook,
        ProgressBarHook,
        StepCounterHook,
        StopAtStepHook,
        SummarySaverHook,
        Text,
        latest_checkpoint_step,
    )


#: The public submodules, each its own name.
_SUBMODULES = ("datasets", "distributed", "hooks", "models")
#: Each module that defines public names, and those names.
_PUBLIC = {
    "jaxmon._base.errors": ("AbortedError", "ConfigError", "NanLossDuringTrainingError", "UnavailableError"),
    "jaxmon._base.hook": (
        "Hook", "RunArgs", "RunContext", "RunValues", "SessionRunArgs", "SessionRunContext", "SessionRunHook",
        "SessionRunValues",
    ),
    "jaxmon._base.triggers": ("NeverTriggerTimer", "SecondOrStepTimer", "Trigger"),
    "jaxmon._checkpoints.manager": ("Restored", "checkpoints_iterator", "restore_checkpoint"),
    "jaxmon._checkpoints.warm_start": ("WarmStartReport",),
    "jaxmon._data.arrays": ("ArrayDataSource",),
    "jaxmon._data.loaders": ("ResumableIterator",),
    "jaxmon._experiment.config_file": ("apply_overrides", "load_config"),
    "jaxmon._experiment.tasks": ("Task", "TaskContext"),
    "jaxmon._experiment.train": ("train_experiment",),
    "jaxmon._metrics.reductions": ("FirstNonFinite", "Last", "Mean", "Ratio", "Reduction", "Sum"),
    "jaxmon._ops.host_syncs": ("HostSyncError",),
    "jaxmon._processes.agree": ("PeerError",),
    "jaxmon._run.session": ("MonitoredSession",),
    "jaxmon._run.train_state": ("TrainState",),
    "jaxmon._run.training": ("USE_DEFAULT", "MonitoredTrainingSession"),
    "jaxmon._writers": ("JsonlWriter", "MlflowWriter", "MultiWriter", "SummaryWriter", "SummaryWriterCache",
                        "TensorBoardWriter", "WandbWriter"),
    "jaxmon.hooks": (
        "CheckpointSaverHook", "CheckpointSaverListener", "EarlyStoppingHook", "EvalHook", "FeedFnHook",
        "FinalOpsHook", "GlobalStepWaiterHook", "GoodputHook", "Histogram", "Image", "LoggingHook",
        "LoggingTensorHook", "NanHook", "NanTensorHook", "PeriodicHook", "ProfilerHook", "ProgressBarHook",
        "StepCounterHook", "StopAtStepHook", "SummarySaverHook", "Text", "latest_checkpoint_step",
    ),
}
#: {public name: its module}, for `__getattr__`.
_MODULE_OF = {name: f"jaxmon.{name}" for name in _SUBMODULES} | {
    name: module for module, names in _PUBLIC.items() for name in names}


def __getattr__(name: str) -> Any:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = importlib.import_module(module)
    if module != f"{__name__}.{name}":
        value = getattr(value, name)
    globals()[name] = value  # once: later lookups find it here
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_MODULE_OF))


__version__ = "0.1.0"

__all__ = [
    "AbortedError",
    "ArrayDataSource",
    "ResumableIterator",
    "CheckpointSaverHook",
    "CheckpointSaverListener",
    "ConfigError",
    "EarlyStoppingHook",
    "EvalHook",
    "FeedFnHook",
    "FinalOpsHook",
    "FirstNonFinite",
    "GlobalStepWaiterHook",
    "GoodputHook",
    "Histogram",
    "Hook",
    "HostSyncError",
    "Image",
    "JsonlWriter",
    "Last",
    "LoggingHook",
    "LoggingTensorHook",
    "Mean",
    "MlflowWriter",
    "MonitoredSession",
    "MonitoredTrainingSession",
    "MultiWriter",
    "NanHook",
    "NanLossDuringTrainingError",
    "NanTensorHook",
    "NeverTriggerTimer",
    "PeerError",
    "PeriodicHook",
    "ProfilerHook",
    "ProgressBarHook",
    "Ratio",
    "Reduction",
    "Restored",
    "RunArgs",
    "RunContext",
    "RunValues",
    "SecondOrStepTimer",
    "SessionRunArgs",
    "SessionRunContext",
    "SessionRunHook",
    "SessionRunValues",
    "StepCounterHook",
    "StopAtStepHook",
    "Sum",
    "Task",
    "TaskContext",
    "SummarySaverHook",
    "SummaryWriter",
    "SummaryWriterCache",
    "TensorBoardWriter",
    "Text",
    "TrainState",
    "Trigger",
    "USE_DEFAULT",
    "UnavailableError",
    "WandbWriter",
    "WarmStartReport",
    "apply_overrides",
    "checkpoints_iterator",
    "datasets",
    "distributed",
    "hooks",
    "latest_checkpoint_step",
    "load_config",
    "models",
    "restore_checkpoint",
    "train_experiment",
]
