"""Bad configs and refused resumes as a user meets them: `jaxmon train` ends each in
exit 2 and one line naming the file (and line), the key or the value, within bounded
memory and time; a refused run leaves no directory it created; a resume refuses every
optimizer change; a run resumed at its last step evaluates the restored state."""

import json
import re
import resource
import shutil
import subprocess
import sys
import time

import pytest
from helpers import DEFAULT, ROOT, assert_fails, train

import jaxmon as jm

GIB = 2**30


def nine_times(alias):
    return "[" + ",".join([f"*{alias}"] * 9) + "]"


LEVELS = list(zip("abcdefgh", "bcdefghi", strict=True))
#: "lol" nine times, nine times over, nine levels deep (343 bytes): 9^9 values once expanded.
LAUGHS = 'a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]\n' + "".join(
    f"{name}: &{name} {nine_times(previous)}\n" for previous, name in LEVELS)
#: The same through merge keys, which PyYAML copies into each mapping as it builds it.
MERGES = "a: &a {x: 1, y: 2}\n" + "".join(f"{name}: &{name} {{<<: {nine_times(previous)}, z: 1}}\n"
                                           for previous, name in LEVELS)


def limited_train(workdir, *args, config, memory=2 * GIB, timeout=60):
    """`jaxmon train` with its address space bounded to `memory` (a normal start-up
    that fails on its config needs about 1 GiB here)."""
    def bound():
        resource.setrlimit(resource.RLIMIT_AS, (memory, memory))

    return subprocess.run([sys.executable, "-m", "jaxmon", "train", "--config", str(config), "--workdir",
                           str(workdir), *map(str, args)], capture_output=True, text=True, timeout=timeout,
                          cwd=ROOT, preexec_fn=bound)


@pytest.mark.parametrize("text, line", [(LAUGHS, 7), (MERGES, 7)], ids=["aliases", "merge-keys"])
def test_a_yaml_alias_bomb_exits_2_at_once_in_bounded_memory(tmp_path, text, line):
    config = tmp_path / "laughs.yaml"
    config.write_text(text)
    assert len(text) < 400
    start = time.monotonic()
    result = limited_train(tmp_path / "run", config=config)
    assert time.monotonic() - start < 45
    assert_fails(result, 2, f"{config}, line {line}, column", "more than 1,000,000 values", "YAML aliases")
    assert not (tmp_path / "run").exists()


def _big_yaml(path):
    with open(path, "w") as f:  # one long scalar: 100 MB
        f.write("name: ")
        for _ in range(100):
            f.write("a" * 2**20)
    return "is 100.0 MB; a config file is at most 10 MB"


def _typo(path):
    path.write_text(f"import runpy\n\ndef get_config():\n    config = runpy.run_path({DEFAULT!r})['get_config']()\n"
                    "    config['sesion'] = config.pop('session')\n    return config\n")
    return "Unknown config key 'sesion'. Did you mean 'session'?"


@pytest.mark.parametrize("make, args", [
    (_big_yaml, ()),
    (None, ("--config.optimizer.learning_rate=nan",)),
    (None, ("--config.optimizer.learning_rate=1e999",)),
    (_typo, ()),
], ids=["100-MB-yaml", "nan", "inf", "top-level-typo"])
def test_a_huge_config_a_non_finite_value_or_a_misspelled_section_exits_2_in_2_s_before_jax_loads(tmp_path, make,
                                                                                                   args):
    config = tmp_path / ("big.yaml" if make is _big_yaml else "typo.py")
    words = make(config) if make else ("optimizer.learning_rate", "finite", "None to turn the setting off")
    start = time.monotonic()
    result = subprocess.run([sys.executable, "-X", "importtime", "-m", "jaxmon", "train", "--config",
                             str(config if make else DEFAULT), "--workdir", str(tmp_path / "run"), *args],
                            capture_output=True, text=True, timeout=60, cwd=ROOT)
    took = time.monotonic() - start
    lines = result.stderr.splitlines()
    imported = [line.rpartition("|")[2].strip() for line in lines if line.startswith("import time")]
    assert "jaxmon" in imported and "jax" not in imported and "jaxlib" not in imported
    result.stderr = "\n".join(line for line in lines if not line.startswith("import time"))
    assert_fails(result, 2, *([words] if isinstance(words, str) else words))
    assert len(result.stderr.strip().splitlines()) == 1 and took < 2.0, (took, result.stderr)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("text, words", [
    ("x: " + "[" * 5000 + "]" * 5000 + "\n", ["line 1, column 103", "nested more than 100 levels deep"]),
    ("".join(" " * i + "a:\n" for i in range(500)), ["line 100, column 100", "nested more than 100 levels deep"]),
    ("a: &a " + "[" * 60 + "1" + "]" * 60 + "\nb: " + "[" * 50 + "*a" + "]" * 50 + "\n",
     ["line 2", "nested more than 100 levels deep once its YAML aliases are expanded"]),
    ("a: &a [1, *a]\n", ["line 1, column 4", "an alias refers to a value that holds it"]),
], ids=["flow", "block", "through-aliases", "recursive"])
def test_a_yaml_nested_too_deep_or_holding_itself_exits_2_naming_the_line(tmp_path, text, words):
    config = tmp_path / "deep.yaml"
    config.write_text(text)
    assert_fails(limited_train(tmp_path / "run", config=config), 2, f"{config}, ", *words)


@pytest.mark.parametrize("name, data, words", [
    ("exp.yaml", bytes(range(256)) * 4, ["is not UTF-8 text (byte 0x80 at offset 128)"]),
    ("exp.yaml", b"seed: 0\nsteps: \x00\n", ["unacceptable character #x0000"]),
    ("exp.py", b"\x00\x01\x02", ["source code string cannot contain null bytes"]),
], ids=["yaml-binary", "yaml-nul", "python-binary"])
def test_a_binary_config_exits_2_naming_the_file(tmp_path, name, data, words):
    config = tmp_path / name
    config.write_bytes(data)
    last = assert_fails(train(tmp_path / "run", config=config), 2, str(config), *words)
    assert "None" not in last
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("run", [False, True], ids=["configs", "a-run"])
def test_a_directory_given_as_config_exits_2_saying_it_is_one_and_what_is_wanted(tmp_path, run):
    directory = tmp_path / "runs" if run else ROOT / "configs"
    if run:  # what a run leaves: its checkpoints and metrics.jsonl
        (directory / "10").mkdir(parents=True)
        (directory / "metrics.jsonl").write_text("")
    result = train(tmp_path / "run", config=directory)
    words = ([f"'{directory}' is a run directory, not a config file", "the config file the run was trained from",
              f"jaxmon inspect {directory}"] if run else
             [f"'{directory}' is a directory, not a config file", "a Python file defining get_config() or of a YAML "
              "file", "in it: default.py, gpt2_small.py"])
    assert_fails(result, 2, *words)
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("text, words", [
    ("import os\n\ndef helper():\n    return {}['learning_rate']\n\ndef get_config():\n    return helper()\n",
     ["line 4: KeyError: 'learning_rate'", "raised in its get_config()"]),
    ("import os\nimport no_such_module_here\n\ndef get_config():\n    return {}\n",
     ["line 2: ModuleNotFoundError: No module named 'no_such_module_here'", "raised running the config file"]),
    ("def get_config():\n    config = {}\n    config['config'] = config\n    return config\n",
     ["nested more than 100 levels deep (or holds itself)"]),
], ids=["get_config-raises", "import-fails", "holds-itself"])
def test_a_python_config_that_fails_exits_2_naming_the_file_and_line(tmp_path, text, words):
    config = tmp_path / "exp.py"
    config.write_text(text)
    assert_fails(train(tmp_path / "run", config=config), 2, str(config), *words)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("override, words", [
    ("--config.seed=99999999999999999999", ["'seed'", "from 0 to 2**63 - 1", "got 99999999999999999999"]),
    ("--config.seed=-1", ["'seed'", "from 0 to 2**63 - 1", "got -1"]),
    ("--config.model.channels=[-3]", ["model.channels=[-3]", "jaxmon.models:CNN", "(3, 3, 1, -3)"]),
], ids=["seed-too-large", "seed-negative", "negative-channels"])
def test_a_value_that_fails_deep_down_exits_2_naming_its_key_and_value(tmp_path, override, words):
    assert_fails(train(tmp_path / "run", override, "--config.steps=2", "--no_compilation_cache"), 2, *words)
    assert not (tmp_path / "run").exists()  # the session had begun writing there: all of it removed


@pytest.mark.parametrize("section, key, value, words", [
    ("data", "batch_size", [64], "'data.batch_size' must be an int, got a list ([64])"),
    (None, "steps", "100", "'steps' must be an int, got a string ('100')"),
    ("optimizer", "learning_rate", [2e-3], "'optimizer.learning_rate' must be a number or a schedule"),
    ("session", "save_checkpoint_steps", [500], "'session.save_checkpoint_steps' must be an int or None, got a list"),
    ("session", "debug_host_syncs", "yes", "'session.debug_host_syncs' must be True or False, got a string ('yes')"),
], ids=["batch_size", "steps", "learning_rate", "session-int", "session-bool"])
def test_a_config_value_of_another_type_exits_2_in_one_line_naming_the_key_and_the_type(tmp_path, section, key, value,
                                                                                        words):
    config = tmp_path / "typed.py"
    where = f"config[{section!r}]" if section else "config"
    config.write_text(f"import runpy\n\n\ndef get_config():\n    config = runpy.run_path({DEFAULT!r})['get_config']()\n"
                      f"    {where}[{key!r}] = {value!r}\n    return config\n")
    result = train(tmp_path / "run", config=config)
    assert_fails(result, 2, words)
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert not (tmp_path / "run").exists()


def test_a_refused_run_removes_the_directories_it_created_and_nothing_else(tmp_path):
    workdir = tmp_path / "new" / "deeper" / "run"
    assert_fails(train(workdir, "--config.seed=-1"), 2, "'seed'")
    assert not (tmp_path / "new").exists()
    existing = tmp_path / "existing"
    existing.mkdir()
    (existing / "notes.txt").write_text("mine")
    assert_fails(train(existing, "--config.seed=-1"), 2, "'seed'")
    assert sorted(p.name for p in existing.iterdir()) == ["notes.txt"]
    empty = tmp_path / "empty"
    empty.mkdir()
    assert_fails(train(empty / "run", "--config.model.channels=[-3]", "--no_compilation_cache"), 2, "model.channels")
    assert empty.is_dir() and not list(empty.iterdir())  # the parent that existed stays


# -- resumes: what the checkpoints depend on, and a run already at its last step --------------------------------------

STEPS = 3


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A run trained to its last step (eval split "test") and the same run evaluated
    on the train split: {name: (workdir, its last stdout line)}."""
    root, runs = tmp_path_factory.mktemp("finished"), {}
    for name, extra in (("run", []), ("on_train", ["--config.data.eval_split=train"])):
        result = train(root / name, f"--config.steps={STEPS}", *extra)
        assert result.returncode == 0, result.stderr[-3000:]
        runs[name] = root / name, result.stdout.strip().splitlines()[-1]
    return runs


def with_b1(directory):
    """A config file: the default one with `optimizer.b1` (Adam's) given."""
    config = directory / "with_b1.py"
    config.write_text(f"import runpy\n\n\ndef get_config():\n    config = runpy.run_path({DEFAULT!r})['get_config']()\n"
                      "    config['optimizer']['b1'] = 0.8\n    return config\n")
    return config


@pytest.mark.parametrize("override, change", [
    ("--config.optimizer.learning_rate=0.001", "optimizer.learning_rate: 0.002 -> 0.001"),
    (None, "optimizer.b1: '<absent>' -> 0.8"),
    ("--config.optimizer.name=sgd", "optimizer.name: 'adam' -> 'sgd'"),
], ids=["learning-rate", "new-argument", "name"])
def test_a_resume_that_changes_the_optimizer_is_refused_naming_the_key_and_the_fix(finished, tmp_path, override,
                                                                                   change):
    workdir, _ = finished["run"]
    before = sorted(p.name for p in workdir.iterdir())
    if override is None:
        result = train(workdir, f"--config.steps={STEPS}", config=with_b1(tmp_path))
    else:
        result = train(workdir, f"--config.steps={STEPS}", override)
    last = assert_fails(result, 2, f"latest step {STEPS}", change, f"--config.warm_start={workdir}")
    assert last.count("->") == 1
    assert sorted(p.name for p in workdir.iterdir()) == before and jm.latest_checkpoint_step(workdir) == STEPS


def test_the_refusal_s_fix_warm_starts_a_new_run_with_the_new_learning_rate(finished, tmp_path):
    workdir, _ = finished["run"]
    new = tmp_path / "lower_lr"
    result = train(new, f"--config.steps={STEPS}", "--config.optimizer.learning_rate=0.001",
                   f"--config.warm_start={workdir}", "--no_compilation_cache")
    assert result.returncode == 0, result.stderr[-3000:]
    assert jm.latest_checkpoint_step(new) == STEPS
    assert json.loads((new / "hparams.json").read_text())["optimizer.learning_rate"] == 0.001


def test_a_run_resumed_at_its_last_step_evaluates_the_restored_state(finished, tmp_path):
    (workdir, on_test), (other, on_train) = finished["run"], finished["on_train"]
    assert re.fullmatch(rf"step {STEPS}: test accuracy [\d.]+, loss [\d.]+  \({workdir}\)", on_test)
    copy = tmp_path / "copy"
    shutil.copytree(workdir, copy)
    # The eval split may change on a resume: the checkpoint's state, evaluated on the train split now, is what
    # the same run evaluated there (the evaluations stored with the checkpoint are of the test split).
    again = train(copy, f"--config.steps={STEPS}", "--config.data.eval_split=train")
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"already at the last step ({STEPS}): evaluating only" in again.stdout
    got = again.stdout.strip().splitlines()[-1]
    assert got.replace(str(copy), "DIR") == on_train.replace(str(other), "DIR")
    assert got.split(":")[1] != on_test.split(":")[1]
