"""Every public name imports from the top level, with TF 1.x aliases where API.md lists them."""

import jaxmon as jm


def test_every_name_in_all_is_importable():
    for name in jm.__all__:
        assert getattr(jm, name) is not None, name
    assert sorted(jm.__all__) == sorted(set(jm.__all__))


def test_tf_names_are_aliases_of_the_jaxmon_names():
    assert jm.SessionRunHook is jm.Hook
    assert jm.SessionRunArgs is jm.RunArgs
    assert jm.SessionRunContext is jm.RunContext
    assert jm.SessionRunValues is jm.RunValues


def test_errors_subclass_the_builtin_they_resemble():
    assert issubclass(jm.AbortedError, RuntimeError) and issubclass(jm.UnavailableError, RuntimeError)


def test_every_public_name_loads_from_the_one_list_and_the_list_is_all():
    assert set(jm._MODULE_OF) == set(jm.__all__)  # the `if TYPE_CHECKING:` imports are `__all__`
    assert set(jm.__all__) <= set(dir(jm))
    assert jm.hooks.EvalHook is jm.EvalHook and jm.models.__name__ == "jaxmon.models"
    try:
        jm.NoSuchName  # noqa: B018
    except AttributeError as error:
        assert "'jaxmon' has no attribute 'NoSuchName'" in str(error)
    else:
        raise AssertionError("jm.NoSuchName gave no AttributeError")
