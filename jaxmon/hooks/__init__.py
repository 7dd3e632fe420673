"""Built-in hooks."""

from jaxmon.hooks._stop import StopAtStepHook

__all__ = ["StopAtStepHook"]
