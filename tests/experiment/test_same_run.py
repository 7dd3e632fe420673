"""Resuming a run: the config's changes since its latest checkpoint, one line each, and
a change of what the checkpoints depend on (seed, task, model, data, optimizer) refused
with the ways out. (A run killed and resumed: tests/end_to_end/test_same_run.py.)"""

import json
import shutil

import pytest
from helpers import ROOT, cpu_env, read_jsonl, run_jaxmon

import jaxmon as jm
from jaxmon._checkpoints.step_dirs import COMMIT_MARKER
from jaxmon._experiment.same_run import check_same_run, report_changes, stalled_rate

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


# -- a changed schedule ---------------------------------------------------------------------------

COSINE = {"name": "warmup_cosine_decay_schedule", "init_value": 0.0, "peak_value": 0.005, "warmup_steps": 20,
          "decay_steps": 200}


def with_schedule(steps=200, accumulate=1, **schedule):
    config = changed(steps=steps)
    config["optimizer"] = {"name": "adamw", "learning_rate": {**COSINE, **schedule}, "accumulate_steps": accumulate}
    return config


def test_a_schedule_s_arguments_may_change_on_a_resume_in_one_line_but_not_its_name():
    extended = with_schedule(steps=300, decay_steps=300, peak_value=0.004)
    assert check_same_run(with_schedule(), extended, "runs/a", 200) == [
        "steps: 200 -> 300",
        "the learning-rate schedule (decay_steps 200 -> 300, peak_value 0.005 -> 0.004): the run goes on with the "
        "new one from its update count"]
    renamed = with_schedule()
    renamed["optimizer"]["learning_rate"]["name"] = "warmup_exponential_decay_schedule"
    with pytest.raises(jm.ConfigError, match=r"optimizer.learning_rate.name: 'warmup_cosine_decay_schedule' -> "):
        check_same_run(with_schedule(), renamed, "runs/a", 200)


def test_steps_extended_past_a_schedule_that_ended_say_so_in_one_line_with_the_key_to_extend():
    assert stalled_rate(with_schedule(steps=300), 200) == (
        "The learning rate is 0 from step 200 to step 300: the schedule ended before the new last step, so these "
        "steps would not change the parameters; extend the schedule with the steps, e.g. "
        "--config.optimizer.learning_rate.decay_steps=300.")
    assert stalled_rate(with_schedule(steps=300, decay_steps=300), 200) is None
    assert stalled_rate(with_schedule(steps=200), 200) is None  # nothing left to train
    assert stalled_rate(with_schedule(steps=150), 100) is None  # still decaying
    # with accumulation a step is still one update: the schedule counts steps
    assert stalled_rate(with_schedule(steps=300, accumulate=4), 200) == stalled_rate(with_schedule(steps=300), 200)
    assert stalled_rate(changed(steps=300), 200) is None  # a constant rate


def test_jaxmon_train_extends_a_finished_cosine_run_at_a_nonzero_rate_and_says_so_of_steps_alone(tmp_path):
    small = ["--config.model.num_layers=1", "--config.model.embed_dim=16", "--config.model.mlp_dim=32",
             "--config.model.num_heads=2", "--config.data.seq_len=16", "--config.model.max_len=16",
             "--config.data.batch_size=4", "--config.optimizer.learning_rate.warmup_steps=2",
             "--config.session.save_summaries_steps=5", "--config.hooks.1.every_n_steps=1000"]

    def train(workdir, steps, *more):
        return run_jaxmon(["train", "--config", "configs/lm.py", "--workdir", workdir, f"--config.steps={steps}",
                           *small, *more], cwd=ROOT, env=cpu_env(), timeout=300)

    workdir = tmp_path / "run"
    done = train(workdir, 20, "--config.optimizer.learning_rate.decay_steps=20")
    assert done.returncode == 0, done.stderr[-3000:]
    copy = tmp_path / "steps_alone"
    shutil.copytree(workdir, copy)

    extended = train(workdir, 30, "--config.optimizer.learning_rate.decay_steps=30")
    assert extended.returncode == 0, extended.stderr[-3000:]
    assert ("Changed since step 20: the learning-rate schedule (decay_steps 20 -> 30): the run goes on with the new "
            "one from its update count") in extended.stdout, extended.stdout
    rates = {row["step"]: row["learning_rate"] for row in read_jsonl(workdir / "metrics.jsonl")
             if "learning_rate" in row}
    # means of each window: decaying to 0 by step 20, then up again on the new schedule (the old one: 0 after 20)
    assert rates[15] > rates[20] and rates[25] > rates[20] and rates[30] > 0, rates

    alone = train(copy, 30, "--config.optimizer.learning_rate.decay_steps=20")
    assert alone.returncode == 0, alone.stderr[-3000:]
    lines = [line for line in alone.stdout.splitlines() + alone.stderr.splitlines() if "learning rate is 0" in line]
    assert lines == ["The learning rate is 0 from step 20 to step 30: the schedule ended before the new last step, "
                     "so these steps would not change the parameters; extend the schedule with the steps, e.g. "
                     "--config.optimizer.learning_rate.decay_steps=30."], alone.stdout + alone.stderr
