"""jaxmon: TF 1.x's MonitoredSession and hooks, re-made for JAX."""

from jaxmon._checkpoint import Restored, WarmStartReport, checkpoints_iterator, restore_checkpoint
from jaxmon._data import ArrayDataSource
from jaxmon._errors import AbortedError, NanLossDuringTrainingError, UnavailableError
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
from jaxmon._session import MonitoredSession
from jaxmon._state import TrainState
from jaxmon._summary import JsonlWriter, MultiWriter, SummaryWriter, SummaryWriterCache, TensorBoardWriter
from jaxmon._triggers import NeverTriggerTimer, SecondOrStepTimer
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
    "CheckpointSaverHook",
    "CheckpointSaverListener",
    "EarlyStoppingHook",
    "EvalHook",
    "FeedFnHook",
    "FinalOpsHook",
    "GlobalStepWaiterHook",
    "Histogram",
    "Hook",
    "Image",
    "JsonlWriter",
    "LoggingHook",
    "LoggingTensorHook",
    "MonitoredSession",
    "MultiWriter",
    "NanHook",
    "NanLossDuringTrainingError",
    "NanTensorHook",
    "NeverTriggerTimer",
    "Restored",
    "PeriodicHook",
    "ProfilerHook",
    "ProgressBarHook",
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
    "SummarySaverHook",
    "SummaryWriter",
    "SummaryWriterCache",
    "TensorBoardWriter",
    "Text",
    "TrainState",
    "UnavailableError",
    "WarmStartReport",
    "checkpoints_iterator",
    "latest_checkpoint_step",
    "restore_checkpoint",
]
