"""Built-in hooks."""

from jaxmon.hooks._checkpoint import CheckpointSaverHook, CheckpointSaverListener
from jaxmon.hooks._early_stopping import EarlyStoppingHook
from jaxmon.hooks._eval import EvalHook
from jaxmon.hooks._feed import FeedFnHook
from jaxmon.hooks._final_ops import FinalOpsHook
from jaxmon.hooks._goodput import GoodputHook
from jaxmon.hooks._logging import LoggingHook, LoggingTensorHook
from jaxmon.hooks._nan import NanHook, NanTensorHook
from jaxmon.hooks._periodic import PeriodicHook
from jaxmon.hooks._profiler import ProfilerHook
from jaxmon.hooks._progress import ProgressBarHook
from jaxmon.hooks._step_counter import StepCounterHook
from jaxmon.hooks._stop import StopAtStepHook
from jaxmon.hooks._summaries import Histogram, Image, SummarySaverHook, Text
from jaxmon.hooks._waiter import GlobalStepWaiterHook, latest_checkpoint_step

__all__ = [
    "CheckpointSaverHook",
    "CheckpointSaverListener",
    "EarlyStoppingHook",
    "EvalHook",
    "FeedFnHook",
    "FinalOpsHook",
    "GlobalStepWaiterHook",
    "GoodputHook",
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
