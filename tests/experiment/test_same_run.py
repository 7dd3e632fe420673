"""Resuming a run: the config's changes since its latest checkpoint, one line each, and
a change of what the checkpoints depend on (seed, task, model, data, optimizer) refused
with the ways out. (A run killed and resumed: tests/end_to_end/test_same_run.py.)"""

import json

import pytest

import jaxmon as jm
from jaxmon._checkpoints.step_dirs import COMMIT_MARKER
from jaxmon._experiment.same_run import check_same_run, report_changes

SAVED = {"seed": 0, "steps": 100, "task": "classify", "model": {"features": [64, 64]},
         "data": {"batch_size": 32, "eval_split": "test", "eval_batch_size": None},
         "optimizer": {"name": "adam", "learning_rate": 0.001}, "session": {"log_step_count_steps": 10}}


def changed(**keys):
    """SAVED with dotted `keys` set ("data__batch_size": data.batch_size)."""
    config = json.loads(json.dumps(SAVED))
    for dotted, value in keys.items():
        *path, last = dotted.split("__")
        section = config
        for name in path:
            section = section[name]
        section[last] = value
    return config


def test_changes_the_checkpoints_do_not_depend_on_are_listed_one_line_each():
    config = changed(steps=200, session__log_step_count_steps=None, data__eval_split="validation",
                     data__eval_batch_size=64)
    config["hooks"] = []
    assert check_same_run(SAVED, config, "runs/a", 50) == [
        "data.eval_batch_size: None -> 64", "data.eval_split: 'test' -> 'validation'", "hooks: '<absent>' -> []",
        "session.log_step_count_steps: 10 -> None", "steps: 100 -> 200"]
    assert check_same_run(SAVED, SAVED, "runs/a", 50) == []
    assert check_same_run(None, SAVED, "runs/a", 50) == []  # a checkpoint without a config: nothing to compare


@pytest.mark.parametrize("keys, words", [
    ({"seed": 1}, "seed: 0 -> 1"),
    ({"model__features": [64, 32]}, "model.features.1: 64 -> 32"),
    ({"model__features": [64]}, "model.features: [64, 64] -> [64]"),
    ({"data__batch_size": 16}, "data.batch_size: 32 -> 16"),
    ({"optimizer__learning_rate": 0.01}, "optimizer.learning_rate: 0.001 -> 0.01"),
    ({"task": "regress", "seed": 3}, "seed: 0 -> 3; task: 'classify' -> 'regress'"),
], ids=["seed", "features", "layers", "batch", "rate", "two"])
def test_a_change_the_checkpoints_depend_on_is_refused_naming_it_and_the_ways_out(keys, words):
    with pytest.raises(jm.ConfigError) as error:
        check_same_run(SAVED, changed(**keys), "runs/a", 50)
    assert str(error.value) == (
        f"runs/a holds checkpoints (latest step 50) of a run whose config differs where the checkpoints depend on "
        f"it: {words}. Resume with the same settings, use a new --workdir, or warm-start a new run from this one "
        "(--config.warm_start=runs/a).")


def checkpoint(workdir, step, meta):
    """A complete step directory of `workdir` whose meta item is `meta` (None: unreadable)."""
    (workdir / str(step) / "meta").mkdir(parents=True)
    (workdir / str(step) / COMMIT_MARKER).write_text("")
    (workdir / str(step) / "meta" / "metadata").write_text("{cut" if meta is None else json.dumps(meta))


def test_the_changes_are_reported_against_the_newest_checkpoint_whose_config_reads(tmp_path):
    checkpoint(tmp_path, 10, {"config": changed(steps=10)})
    checkpoint(tmp_path, 20, {"config": changed(steps=20)})
    checkpoint(tmp_path, 30, None)  # unreadable: the one before it is the run's latest config
    (tmp_path / "40").mkdir()  # not complete
    said = []
    report_changes(changed(steps=300), str(tmp_path), said.append)
    assert said == ["Changed since step 20: steps: 20 -> 300"]


def test_nothing_is_reported_without_a_checkpoint_and_a_breaking_change_is_raised(tmp_path):
    said = []
    report_changes(SAVED, str(tmp_path / "missing"), said.append)
    report_changes(SAVED, str(tmp_path), said.append)
    assert said == []
    checkpoint(tmp_path, 5, {"config": SAVED})
    with pytest.raises(jm.ConfigError, match=r"\(latest step 5\).*seed: 0 -> 9"):
        report_changes(changed(seed=9), str(tmp_path), said.append)
    assert said == []
