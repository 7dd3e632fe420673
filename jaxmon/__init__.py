"""jaxmon: TF 1.x's MonitoredSession and hooks, re-made for JAX."""

# First, before JAX loads: in the `jaxmon` command, Ctrl-C and SIGTERM are handled from here on.
from jaxmon import _cli_signals  # noqa: F401  isort: skip
from jaxmon import datasets, distributed, models
from jaxmon._agree import PeerError
from jaxmon._checkpoint import Restored, checkpoints_iterator, restore_checkpoint
from jaxmon._data import ArrayDataSource
from jaxmon._errors import AbortedError, NanLossDuringTrainingError, UnavailableError
from jaxmon._experiment import train_experiment
from jaxmon._experiment.config_file import ConfigError, apply_overrides, load_config
from jaxmon._experiment.tasks import Task, TaskContext
from jaxmon._hook import (
    Hook,
    RunArgs,
    RunContext,
    RunValues,
    SessionRunArgs,
    SessionRunContext,
    SessionRunHook,
    SessionRunValues,
)
from jaxmon._loaders import ResumableIterator
from jaxmon._reductions import FirstNonFinite, Last, Mean, Ratio, Reduction, Sum
from jaxmon._session import MonitoredSession
from jaxmon._state import TrainState
from jaxmon._training import USE_DEFAULT, MonitoredTrainingSession
from jaxmon._triggers import NeverTriggerTimer, SecondOrStepTimer, Trigger
from jaxmon._warm_start import WarmStartReport
from jaxmon._writers import JsonlWriter, MultiWriter, SummaryWriter, SummaryWriterCache, TensorBoardWriter
from jaxmon.hooks import (
    CheckpointSaverHook,
    CheckpointSaverListener,
    EarlyStoppingHook,
    EvalHook,
    FeedFnHook,
    FinalOpsHook,
    GlobalStepWaiterHook,
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
    "Histogram",
    "Hook",
    "Image",
    "JsonlWriter",
    "Last",
    "LoggingHook",
    "LoggingTensorHook",
    "Mean",
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
    "WarmStartReport",
    "apply_overrides",
    "checkpoints_iterator",
    "datasets",
    "distributed",
    "latest_checkpoint_step",
    "load_config",
    "models",
    "restore_checkpoint",
    "train_experiment",
]
