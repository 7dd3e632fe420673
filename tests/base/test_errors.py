"""The shared errors and checks: which errors a session recovers from, the argument checks
and their messages, the error policy, and a type's name with its article."""

import jax
import pytest

from jaxmon._base.errors import (
    AbortedError,
    ConfigError,
    NanLossDuringTrainingError,
    RollbackError,
    UnavailableError,
    check_int,
    check_number,
    check_on_error,
    is_recoverable,
    with_article,
)


def test_jax_runtime_errors_with_aborted_or_unavailable_status_are_recoverable():
    assert is_recoverable(jax.errors.JaxRuntimeError("ABORTED: peer restarted"))
    assert is_recoverable(jax.errors.JaxRuntimeError("UNAVAILABLE: connection reset"))
    assert not is_recoverable(jax.errors.JaxRuntimeError("INTERNAL: something else"))
    assert not is_recoverable(RuntimeError("ABORTED but not from the runtime"))


@pytest.mark.parametrize("name, words", [("int", "an int"), ("list", "a list"), ("OrderedDict", "an OrderedDict"),
                                         ("uint8", "a uint8"), ("UserDict", "a UserDict"), ("ellipsis", "an ellipsis")])
def test_a_type_is_named_with_the_article_it_is_spoken_with(name, words):
    assert with_article(name) == words


def test_the_errors_a_session_recovers_from_and_those_it_does_not():
    assert is_recoverable(AbortedError("a peer restarted")) and is_recoverable(UnavailableError("busy"))
    rollback = RollbackError("NaN loss at step 7", step=7, value=float("nan"))
    assert is_recoverable(rollback)  # a roll-back is a recovery
    assert isinstance(rollback, NanLossDuringTrainingError) and rollback.step == 7
    nan = NanLossDuringTrainingError("NaN loss", step=3, value=float("inf"))
    assert not is_recoverable(nan) and (nan.step, nan.value) == (3, float("inf"))
    assert not is_recoverable(ValueError("bad")) and not is_recoverable(KeyboardInterrupt())
    assert issubclass(ConfigError, ValueError)


@pytest.mark.parametrize("value", [-1, 1.0, True, "3", None])
def test_check_int_names_the_argument_the_bound_and_the_value(value):
    with pytest.raises(ValueError) as error:
        check_int("Hook every_n_steps", value)
    assert str(error.value) == f"Hook every_n_steps must be an int >= 0; got {value!r}."


def test_check_int_takes_ints_at_or_above_the_minimum():
    check_int("n", 0)
    check_int("n", 5, minimum=5)
    with pytest.raises(ValueError, match=r"^n must be an int >= 1; got 0\.$"):
        check_int("n", 0, minimum=1)


def test_check_number_takes_ints_and_floats_and_positive_refuses_zero():
    check_number("secs", 0)
    check_number("secs", 0.5, positive=True)
    with pytest.raises(ValueError, match=r"^secs must be a number >= 0; got -0\.5\.$"):
        check_number("secs", -0.5)
    with pytest.raises(ValueError, match=r"^secs must be a number > 0; got 0\.$"):
        check_number("secs", 0, positive=True)
    for value in (True, "1", None):
        with pytest.raises(ValueError, match="must be a number"):
            check_number("secs", value)


def test_check_on_error_returns_a_policy_and_names_the_owner_of_a_bad_one():
    assert check_on_error("MyHook", "raise") == "raise" and check_on_error("MyHook", "warn") == "warn"
    with pytest.raises(ValueError) as error:
        check_on_error("MyHook", "ignore")
    assert str(error.value) == "MyHook on_error must be 'raise' (the default) or 'warn'; got 'ignore'."
