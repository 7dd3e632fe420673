"""jaxmon: TF 1.x's MonitoredSession and hooks, re-made for JAX."""

from jaxmon._errors import AbortedError, UnavailableError
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
from jaxmon._triggers import NeverTriggerTimer, SecondOrStepTimer
from jaxmon.hooks import StopAtStepHook

__version__ = "0.1.0"

__all__ = [
    "AbortedError",
    "Hook",
    "MonitoredSession",
    "NeverTriggerTimer",
    "RunArgs",
    "RunContext",
    "RunValues",
    "SecondOrStepTimer",
    "SessionRunArgs",
    "SessionRunContext",
    "SessionRunHook",
    "SessionRunValues",
    "StopAtStepHook",
    "TrainState",
    "UnavailableError",
]
