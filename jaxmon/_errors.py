"""Errors jaxmon raises, the test for errors a session recovers from, and argument checks."""

from __future__ import annotations

import jax


class AbortedError(RuntimeError):
    """The run was aborted (e.g. a peer restarted); the session recovers and retries."""


class UnavailableError(RuntimeError):
    """A resource was briefly unavailable; the session recovers and retries."""


_RECOVERABLE_CODES = ("ABORTED", "UNAVAILABLE")


def check_int(name: str, value: object, minimum: int = 0) -> None:
    """Raises a `ValueError` naming `name` unless `value` is an int >= `minimum`."""
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}; got {value!r}.")


def check_number(name: str, value: object) -> None:
    """Raises a `ValueError` naming `name` unless `value` is a number >= 0."""
    if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{name} must be a number >= 0; got {value!r}.")


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
