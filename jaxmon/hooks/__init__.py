"""Built-in hooks."""

from jaxmon.hooks._basic import (
    FeedFnHook,
    FinalOpsHook,
    GlobalStepWaiterHook,
    NanHook,
    NanTensorHook,
    PeriodicHook,
    latest_checkpoint_step,
)
from jaxmon.hooks._checkpoint import CheckpointSaverHook, CheckpointSaverListener
from jaxmon.hooks._eval import EarlyStoppingHook, EvalHook
from jaxmon.hooks._logging import LoggingHook, LoggingTensorHook, ProgressBarHook, StepCounterHook
from jaxmon.hooks._stop import StopAtStepHook
from jaxmon.hooks._summaries import Histogram, Image, ProfilerHook, SummarySaverHook, Text

__all__ = [
    "CheckpointSaverHook",
    "CheckpointSaverListener",
    "EarlyStoppingHook",
    "EvalHook",
    "FeedFnHook",
    "FinalOpsHook",
    "GlobalStepWaiterHook",
    "Histogram",
    "Image",
    "LoggingHook",
    "LoggingTensorHook",
    "NanHook",
    "NanTensorHook",
    "PeriodicHook",
    "ProfilerHook",
    "ProgressBarHook",
    "StepCounterHook",
    "StopAtStepHook",
    "SummarySaverHook",
    "Text",
    "latest_checkpoint_step",
]
