"""Reading an experiment config: its top-level keys, the kind of each key jaxmon reads,
required keys, and import paths, each refused with words that say the fix."""

import os

import pytest

import jaxmon as jm
from jaxmon._experiment.keys import Kind, check_keys, check_kind, check_top_level, get_key, pop_key, resolve
from jaxmon.models import MLP


def test_a_missing_or_mistyped_section_key_says_an_int():
    with pytest.raises(jm.ConfigError, match=r"needs 'steps' \(an int\)"):
        get_key({}, "steps", int)
    with pytest.raises(jm.ConfigError, match="'steps' must be an int"):
        get_key({"steps": "10"}, "steps", int)


def test_an_unknown_top_level_key_is_named_with_the_nearest_known_one():
    check_top_level({"steps": 1, "model": {}})
    with pytest.raises(jm.ConfigError) as error:
        check_top_level({"stpes": 1, "zzz_unheard_of": 2})  # the first in sorted order
    assert str(error.value).startswith("Unknown config key 'stpes'. Did you mean 'steps'? An experiment config "
                                       "has: seed, prng_impl, steps,")
    with pytest.raises(jm.ConfigError, match=r"^Unknown config key 'qqqq'\. An experiment config has"):
        check_top_level({"qqqq": 1})


@pytest.mark.parametrize("config, words", [
    ({"steps": "10"}, "Config key 'steps' must be an int, got a string ('10')"),
    ({"steps": True}, "Config key 'steps' must be an int, got a bool (True)"),
    ({"data": {"batch_size": [64]}}, "Config key 'data.batch_size' must be an int, got a list ([64])"),
    ({"optimizer": {"clip_global_norm": "1"}}, "'optimizer.clip_global_norm' must be a number or None, got a string"),
    ({"optimizer": {"learning_rate": "fast"}}, "must be a number or a schedule"),
    ({"name": 3}, "Config key 'name' must be a string or None, got an int (3)"),
    ({"hooks": None}, "Config key 'hooks' must be a list, got None"),
], ids=["str-steps", "bool-steps", "list-batch", "clip", "rate", "name", "hooks"])
def test_a_key_jaxmon_reads_must_be_of_its_kind(config, words):
    with pytest.raises(jm.ConfigError) as error:
        check_keys(config)
    assert words in str(error.value) and str(error.value).endswith("(configs/default.py shows each key).")


def test_keys_of_their_kind_and_keys_jaxmon_does_not_read_pass():
    check_keys({"steps": 10, "name": None, "model": None, "data": {"batch_size": 8, "source": "anything"},
                "optimizer": {"learning_rate": {"name": "cosine_decay_schedule"}, "clip_global_norm": None},
                "perf": {"peak_tflops": 1.5}, "hooks": [], "writers": None})
    check_keys({"optimizer": None})  # off: its keys are not looked for
    with pytest.raises(jm.ConfigError, match="'data' must be a dict, got a string"):
        check_keys({"data": "not a dict"})


def test_or_none_takes_none_too_and_says_so():
    kind = Kind(lambda value: value == 1, "one").or_none()
    assert kind.accepts(None) and kind.accepts(1) and not kind.accepts(2)
    assert kind.words == "one or None"
    check_kind("k", None, kind)
    with pytest.raises(jm.ConfigError, match="Config key 'k' must be one or None, got an int"):
        check_kind("k", 2, kind)


def test_get_key_gives_a_default_or_the_checked_value():
    assert get_key({}, "steps", int, default=5) == 5
    assert get_key({"steps": 7}, "steps", int) == 7
    with pytest.raises(jm.ConfigError, match=r"'seed' must be an int, got a bool \(False\)"):
        get_key({"seed": False}, "seed", int)


def test_pop_key_takes_a_required_key_out_of_its_section():
    section = {"source": "pkg:fn", "batch_size": 2}
    assert pop_key(section, "source", "data.source") == "pkg:fn" and section == {"batch_size": 2}
    with pytest.raises(jm.ConfigError, match=r"^The experiment config needs 'data\.source'; see configs/default\.py"):
        pop_key(section, "source", "data.source")


def test_resolve_imports_an_object_by_its_path_and_names_what_is_wrong():
    assert resolve("jaxmon.models:MLP", "model.name") is MLP
    assert resolve("jaxmon.models.MLP", "model.name") is MLP
    assert resolve("os.path:join", "k") is os.path.join
    with pytest.raises(jm.ConfigError, match=r"^model.name must be an import path such as 'jaxmon.models:MLP'; got 3"):
        resolve(3, "model.name")
    with pytest.raises(jm.ConfigError, match=r"model.name='no_such_module_here:X': cannot import"):
        resolve("no_such_module_here:X", "model.name")
    with pytest.raises(jm.ConfigError, match=r"jaxmon.models has no 'MPL'\. Did you mean jaxmon.models:MLP\?"):
        resolve("jaxmon.models:MPL", "model.name")
