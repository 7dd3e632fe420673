"""Experiment configs: loading Python and YAML files, type-checked overrides, and errors
that name the key and the fix."""

import textwrap

import pytest
from helpers import ROOT

import jaxmon as jm

BASE = {
    "seed": 0,
    "steps": 100,
    "name": "exp",
    "flag": True,
    "ratio": 0.5,
    "optimizer": {"name": "adam", "learning_rate": 1e-3},
    "features": [64, 64],
    "warm_start": None,
    "hooks": [{"name": "EvalHook", "every_n_steps": 50}],
}


def test_a_python_config_file_is_loaded_and_overridden(tmp_path):
    path = tmp_path / "exp.py"
    path.write_text(f"def get_config():\n    return {BASE!r}\n")
    config = jm.load_config(path, ["--config.optimizer.learning_rate=3e-4", "--config.steps=7"])
    assert config["optimizer"] == {"name": "adam", "learning_rate": 3e-4}
    assert config["steps"] == 7 and config["seed"] == 0


def test_an_object_with_to_dict_is_read_as_a_config_dict(tmp_path):
    # What ml_collections.ConfigDict offers: to_dict() gives plain nested dicts.
    path = tmp_path / "exp.py"
    path.write_text(textwrap.dedent("""
        class ConfigDict:
            def __init__(self, d):
                self._d = d
            def to_dict(self):
                return self._d

        def get_config():
            return ConfigDict({"steps": 3, "optimizer": {"name": "sgd", "learning_rate": 0.1}})
    """))
    assert jm.load_config(path, ["optimizer.learning_rate=0.2"]) == {
        "steps": 3, "optimizer": {"name": "sgd", "learning_rate": 0.2}}


def test_a_yaml_config_file_is_loaded(tmp_path):
    path = tmp_path / "exp.yaml"
    path.write_text("steps: 10\noptimizer:\n  name: adam\n  learning_rate: 0.001\n")
    assert jm.load_config(path, ["--config.steps=20"]) == {"steps": 20, "optimizer": {"name": "adam",
                                                                                       "learning_rate": 0.001}}


def test_yaml_reads_exponent_numbers_as_floats(tmp_path):
    # YAML 1.1 (PyYAML's default) reads 1e-3 as a string; a config means the number.
    path = tmp_path / "exp.yaml"
    path.write_text("lr: 1e-3\nwd: 5E+2\nname: 1e3x\nversion: '1e-3'\n")
    assert jm.load_config(path, ["lr=3e-4"]) == {"lr": 3e-4, "wd": 500.0, "name": "1e3x", "version": "1e-3"}


@pytest.mark.parametrize("override, key, value", [
    ("steps=200", "steps", 200),
    ("ratio=2", "ratio", 2.0),  # an int where a float was: widened
    ("ratio=1e-3", "ratio", 1e-3),
    ("flag=false", "flag", False),
    ("flag=True", "flag", True),
    ("name=run-7", "name", "run-7"),  # not a literal: the text itself
    ("name=123", "name", "123"),  # a string key keeps the text
    ("name='quoted'", "name", "quoted"),
    ("features=[32, 16, 8]", "features", [32, 16, 8]),
    ("warm_start=runs/pretrained", "warm_start", "runs/pretrained"),  # None takes anything
    ("warm_start=5", "warm_start", 5),
    ("steps=None", "steps", None),  # None turns any setting off
    ("name=None", "name", None),
    ("optimizer=None", "optimizer", None),
])
def test_overrides_are_read_as_literals_of_the_right_type(override, key, value):
    config = jm.apply_overrides(BASE, [override])
    assert config[key] == value and type(config[key]) is type(value)


def test_overrides_address_list_items_by_index_and_leave_the_original_alone():
    config = jm.apply_overrides(BASE, ["--config.hooks.0.every_n_steps=10"])
    assert config["hooks"] == [{"name": "EvalHook", "every_n_steps": 10}]
    assert BASE["hooks"][0]["every_n_steps"] == 50


@pytest.mark.parametrize("override, names", [
    ("--config.no_such_key=1", ["'no_such_key'", "Its keys:", "optimizer"]),
    ("optimizer.learnig_rate=1", ["'optimizer.learnig_rate'", "Did you mean 'optimizer.learning_rate'?"]),
    ("stpes=1", ["'stpes'", "Did you mean 'steps'?"]),
    ("hooks.3.every_n_steps=1", ["'hooks.3.every_n_steps'", "list of 1 items", "0..0"]),
    ("hooks.0.every_n_step=1", ["Did you mean 'hooks.0.every_n_steps'?"]),
    ("seed.x=1", ["'seed.x'", "has no keys"]),
])
def test_an_unknown_key_is_named_with_the_nearest_known_one(override, names):
    with pytest.raises(jm.ConfigError) as error:
        jm.apply_overrides(BASE, [override])
    for name in names:
        assert name in str(error.value)
    assert isinstance(error.value, ValueError)


@pytest.mark.parametrize("override, names", [
    ("steps=1.5", ["'steps' is an int (100)", "'1.5' is a float", "--config.steps=100"]),
    ("steps=True", ["'steps' is an int", "is a bool"]),
    ("flag=maybe", ["'flag' is a bool", "'maybe' is text"]),
    ("ratio=fast", ["'ratio' is a float", "is text"]),
    ("features=64", ["'features' is a list", "is an int"]),
    ("optimizer=adam", ["'optimizer' is a dict"]),
])
def test_a_value_of_the_wrong_type_is_an_error_naming_key_and_type(override, names):
    with pytest.raises(jm.ConfigError) as error:
        jm.apply_overrides(BASE, [override])
    for name in names:
        assert name in str(error.value), str(error.value)


@pytest.mark.parametrize("override", ["steps", "=3", "--config.=3"])
def test_a_malformed_override_is_an_error(override):
    with pytest.raises(jm.ConfigError, match="--config.key.sub=value"):
        jm.apply_overrides(BASE, [override])


def test_a_missing_file_or_get_config_is_an_error(tmp_path):
    with pytest.raises(jm.ConfigError, match="No config file"):
        jm.load_config(tmp_path / "nope.py")
    path = tmp_path / "empty.py"
    path.write_text("x = 1\n")
    with pytest.raises(jm.ConfigError, match="defines no get_config"):
        jm.load_config(path)


def test_the_default_config_loads_and_names_what_train_needs():
    config = jm.load_config(ROOT / "configs" / "default.py")
    assert {"seed", "steps", "data", "model", "task", "optimizer", "hooks", "session"} <= set(config)
    assert config["data"]["source"] == "jaxmon.datasets:digits"


def test_an_experiment_config_with_an_unknown_section_is_an_error(tmp_path):
    config = jm.load_config(ROOT / "configs" / "default.py")
    config["optimiser"] = {}
    with pytest.raises(jm.ConfigError, match="'optimiser'. Did you mean 'optimizer'"):
        jm.train_experiment(config, tmp_path)


@pytest.mark.parametrize("change, message", [
    (lambda c: c["model"].update(name="jaxmon.models:MPL"), "Did you mean jaxmon.models:MLP"),
    (lambda c: c["optimizer"].update(name="adamm"), "'adamm' is not an optax function"),
    (lambda c: c["hooks"].append({"name": "EvalHok"}), "Did you mean 'EvalHook'"),
    (lambda c: c["hooks"].append({"every_n_steps": 3}), "hooks.3 must be a dict with a name"),
    (lambda c: c.update(task="ranking"), "task must be one of 'classification', 'regression', 'lm'"),
    (lambda c: c["session"].update(save_checkpoint_secs=5), "Can not provide both"),
    (lambda c: c["data"].update(source="jaxmon.nowhere:data"), "cannot import 'jaxmon.nowhere'"),
])
def test_experiment_errors_name_the_key_and_the_fix(tmp_path, change, message):
    config = jm.load_config(ROOT / "configs" / "default.py")
    change(config)
    with pytest.raises((jm.ConfigError, ValueError), match=message):
        jm.train_experiment(config, tmp_path)


def test_session_keys_are_checked_against_the_session_arguments(tmp_path):
    config = jm.load_config(ROOT / "configs" / "default.py")
    config["session"]["max_to_kep"] = 1
    with pytest.raises(jm.ConfigError, match="session.max_to_kep is not an argument of MonitoredTrainingSession. "
                                             "Did you mean session.max_to_keep?"):
        jm.train_experiment(config, tmp_path)
    config["session"] = {"hooks": []}
    with pytest.raises(jm.ConfigError, match="session.hooks is set by the experiment itself"):
        jm.train_experiment(config, tmp_path)


def test_a_model_that_cannot_be_built_is_not_blamed_on_the_session(tmp_path):
    config = jm.load_config(ROOT / "configs" / "default.py")
    config["model"]["features"] = 16  # not a list: as a YAML file could say
    with pytest.raises(jm.ConfigError) as error:
        jm.train_experiment(config, tmp_path)
    assert "Initialising the model 'jaxmon.models:CNN'" in str(error.value)
    assert "model.features=16" in str(error.value) and "TypeError" in str(error.value)
    assert "session" not in str(error.value)


def test_a_config_may_use_modules_next_to_it_several_steps_per_dispatch_and_hooks_writing_to_the_run(tmp_path):
    import json

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    here = tmp_path / "experiment"
    here.mkdir()
    (here / "blobs_next_to_config.py").write_text(textwrap.dedent("""
        import numpy as np

        def load(split, n=256):
            rng = np.random.default_rng(0 if split == "train" else 1)
            y = rng.integers(0, 2, n)
            x = (rng.standard_normal((n, 4)) + 2.0 * y[:, None]).astype(np.float32)
            return {"x": x, "y": y.astype(np.int32)}
    """))
    (here / "config.py").write_text(textwrap.dedent("""
        import blobs_next_to_config  # a module beside this file, imported by name

        def get_config():
            return {
                "seed": 0, "steps": 40,
                "data": {"source": "blobs_next_to_config:load", "batch_size": 32},
                "model": {"name": "jaxmon.models:MLP", "features": [8], "num_outputs": 2},
                "task": "classification",
                "optimizer": {"name": "adam", "learning_rate": 1e-2},
                "hooks": [{"name": "SummarySaverHook", "save_steps": 10, "summaries": {"h": "accuracy"}},
                          {"name": "StepCounterHook", "every_n_steps": 10}],
                "session": {"steps_per_dispatch": 8, "save_summaries_steps": None, "log_step_count_steps": None},
            }
    """))
    config = jm.load_config(here / "config.py")
    workdir = tmp_path / "run"
    result = jm.train_experiment(config, workdir, report=lambda line: None)
    assert result["step"] == 40
    events = EventAccumulator(str(workdir))
    events.Reload()
    # The hooks named in the config wrote into the run's directory with no output_dir given.
    assert [event.step for event in events.Scalars("h")] == [1, 10, 20, 30, 40]  # step 1, then every 10 steps
    assert [event.step for event in events.Scalars("global_step/sec")] == [10, 20, 30, 40]
    records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    assert {record["step"] for record in records if "h" in record} == {1, 10, 20, 30, 40}
    # The config is the run's hyper-parameters: TensorBoard's HParams dashboard, and hparams.json.
    assert json.loads((workdir / "metrics.jsonl").read_text().splitlines()[0])["hparams"]["seed"] == 0  # the header
    hparams = json.loads((workdir / "hparams.json").read_text())
    assert hparams["optimizer.learning_rate"] == 0.01 and hparams["session.steps_per_dispatch"] == 8
    assert "_hparams_/session_start_info" in events.PluginTagToContent("hparams")


@pytest.mark.parametrize("text, words", [
    ("def get_config():\n    return {'optimizer': {'learning_rate': float('nan')}}\n",
     "'optimizer.learning_rate' is nan"),
    ("def get_config():\n    return {'hooks': [{'secs': float('-inf')}]}\n", "'hooks.0.secs' is -inf"),
], ids=["nan", "inf-in-a-list"])
def test_a_non_finite_float_in_the_file_is_refused_naming_its_key(tmp_path, text, words):
    path = tmp_path / "exp.py"
    path.write_text(text)
    with pytest.raises(jm.ConfigError, match="a run needs a finite number there") as info:
        jm.load_config(path)
    assert words in str(info.value)


@pytest.mark.parametrize("raw", ["nan", "inf", "-Infinity", "1e999"])
def test_a_non_finite_override_of_a_float_is_refused_naming_the_key_and_a_fix(tmp_path, raw):
    path = tmp_path / "exp.py"
    path.write_text("def get_config():\n    return {'optimizer': {'learning_rate': 0.1}}\n")
    with pytest.raises(jm.ConfigError, match=r"'optimizer.learning_rate'.*finite.*(--config.optimizer.learning_rate="
                                             r"0.1|None to turn the setting off)"):
        jm.load_config(path, [f"--config.optimizer.learning_rate={raw}"])


def test_a_config_file_over_10_mb_is_refused_before_it_runs(tmp_path):
    path = tmp_path / "exp.py"
    path.write_text("raise SystemExit('ran')\n" + "#" * (10 * 2**20))
    with pytest.raises(jm.ConfigError, match=r"is 10.0 MB; a config file is at most 10 MB"):
        jm.load_config(path)


def test_a_top_level_section_the_config_leaves_out_can_be_given_whole_on_the_command_line(tmp_path):
    path = tmp_path / "exp.yaml"
    path.write_text("steps: 10\noptimizer:\n  name: adam\n  learning_rate: 0.001\n")
    config = jm.load_config(path, ["--config.writers=[{'name': 'wandb', 'project': 'lm', 'mode': 'offline'}]",
                                   "--config.warm_start=runs/old"])
    assert config["writers"] == [{"name": "wandb", "project": "lm", "mode": "offline"}]
    assert config["warm_start"] == "runs/old"
    with pytest.raises(jm.ConfigError, match="Unknown config key 'writer': the config has no key 'writer'"):
        jm.load_config(path, ["--config.writer=[]"])  # not a section a config has
    with pytest.raises(jm.ConfigError, match="Unknown config key 'writers.0.name'"):
        jm.load_config(path, ["--config.writers.0.name=wandb"])  # absent: given whole, not item by item
