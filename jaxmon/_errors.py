"""Errors jaxmon raises, and the test for errors a session recovers from."""

from __future__ import annotations

import jax


class AbortedError(RuntimeError):
    """The run was aborted (e.g. a peer restarted); the session recovers and retries."""


class UnavailableError(RuntimeError):
    """A resource was briefly unavailable; the session recovers and retries."""


_RECOVERABLE_CODES = ("ABORTED", "UNAVAILABLE")


def is_recoverable(error: BaseException) -> bool:
    """Whether a `MonitoredSession` recovers from `error` and retries the run.

    True for `AbortedError`, `UnavailableError`, and JAX runtime errors whose status
    is ABORTED or UNAVAILABLE (the TF 1.x preemption errors).
    """
    if isinstance(error, (AbortedError, UnavailableError)):
        return True
    if isinstance(error, jax.errors.JaxRuntimeError):
        return str(error).lstrip().startswith(_RECOVERABLE_CODES)
    return False
