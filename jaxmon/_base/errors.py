"""Errors jaxmon raises, the test for errors a session recovers from, argument checks,
and the words they are said in. Loads no JAX: the command says a config's error before
JAX loads."""

from __future__ import annotations


class ConfigError(ValueError):
    """A config that cannot be loaded, or an override that does not fit it."""


class AbortedError(RuntimeError):
    """The run was aborted (e.g. a peer restarted); the session recovers and retries."""


class UnavailableError(RuntimeError):
    """A resource was briefly unavailable; the session recovers and retries."""


_RECOVERABLE_CODES = ("ABORTED", "UNAVAILABLE")


def check_int(name: str, value: object, minimum: int = 0) -> None:
    """Raises a `ValueError` naming `name` unless `value` is an int >= `minimum`."""
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}; got {value!r}.")


def check_number(name: str, value: object, positive: bool = False) -> None:
    """Raises a `ValueError` naming `name` unless `value` is a number >= 0 (> 0 if `positive`)."""
    if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0 or (positive and value == 0):
        raise ValueError(f"{name} must be a number {'>' if positive else '>='} 0; got {value!r}.")


def is_recoverable(error: BaseException) -> bool:
    """Whether a `MonitoredSession` recovers from `error` and retries the run.

    True for `AbortedError`, `UnavailableError`, and JAX runtime errors whose status
    is ABORTED or UNAVAILABLE (the TF 1.x preemption errors).
    """
    if isinstance(error, (AbortedError, UnavailableError)):
        return True
    import jax  # loaded by then: the error came from a run

    if isinstance(error, jax.errors.JaxRuntimeError):
        return str(error).lstrip().startswith(_RECOVERABLE_CODES)
    return False


class NanLossDuringTrainingError(RuntimeError):
    """A `NanHook` saw a non-finite loss; `step` and `value` say where and what."""

    def __init__(self, message: str, *, step: int | None = None, value: object = None):
        super().__init__(message)
        self.step, self.value = step, value


class RollbackError(NanLossDuringTrainingError, AbortedError):
    """A `NanHook(on_nan="rollback")` saw a bad step (`step`): the session restores the newest
    checkpoint, skips the batches from it through `step`, and goes on (a recovery). Raised
    where no recovery is possible (at `close()`), it is the `NanLossDuringTrainingError`."""


def check_on_error(owner: object, on_error: object) -> str:
    """Returns `on_error` if it is a valid hook error policy, else raises `ValueError`
    naming `owner` (a hook or a str, formatted only on error)."""
    if on_error not in ("raise", "warn"):
        raise ValueError(f"{owner} on_error must be 'raise' (the default) or 'warn'; got {on_error!r}.")
    return on_error


#: Type names spoken from a consonant though written from a vowel ("a uint8", "a unicode").
_SPOKEN_YOU = ("uint", "uni", "us", "uu")


def with_article(name: str) -> str:
    """A type's `name` with its indefinite article, as it is spoken.

    Example:
      >>> [with_article(name) for name in ("int", "list", "OrderedDict", "uint8", "str")]
      ['an int', 'a list', 'an OrderedDict', 'a uint8', 'a str']
    """
    lower = name.lower()
    vowel = lower[:1] in ("a", "e", "i", "o") or (lower[:1] == "u" and not lower.startswith(_SPOKEN_YOU))
    return f"{'an' if vowel else 'a'} {name}"
