"""`jaxmon check --resume` on real runs: the default config resumes as one run (on the same
and on another number of processes); data without a position, or drawn at random without a
seed, is said in one line; a directory of its own is removed however the check ends."""

import signal
import subprocess
import sys
import time

import pytest
import warm_processes
from helpers import DEFAULT, ROOT, cpu_env, run_jaxmon, tiny_config

from jaxmon._cli.resume_check import HELD

HEADER = "jaxmon check --resume: 20 steps of "

PLAIN_GENERATOR = '''
import jaxmon as jm


def load(split, **kwargs):
    arrays = jm.datasets.digits(split)
    if split != "train":
        return arrays

    def batches():  # a plain generator: no position to resume from
        for i in range(0, 10**6, 32):
            yield {key: value[i % 1000:i % 1000 + 32] for key, value in arrays.items()}
    return batches()
'''

#: The config at BASE, its training data from `PLAIN_GENERATOR`.
GENERATOR_CONFIG = '''
import runpy


def get_config():
    config = runpy.run_path(BASE)["get_config"]()
    config["data"] = {"source": "plain_data:load", "batch_size": 32}
    return config
'''


UNSEEDED_DATA = '''
import numpy as np

import jaxmon as jm


def load(split, **kwargs):
    arrays = jm.datasets.digits(split)
    if split == "train":  # noise drawn without a seed: other values in every process
        arrays["x"] = arrays["x"] + np.random.default_rng().normal(size=arrays["x"].shape).astype(np.float32)
    return arrays
'''


def check_resume(*args, env=None):
    return run_jaxmon(["check", "--resume", *args], cwd=ROOT, env=env or cpu_env(), timeout=600)


def scratch(tmp_path):
    """An empty temporary directory for the check's own (TMPDIR), and its environment."""
    temporary = tmp_path / "tmp"
    temporary.mkdir()
    return temporary, {**cpu_env(), "TMPDIR": str(temporary)}


def test_the_default_config_cut_by_sigkill_and_resumed_is_the_whole_run(tmp_path):
    result = check_resume("--config", DEFAULT, "--workdir", tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    header, verdict = result.stdout.strip().splitlines()
    assert header == (f"{HEADER}{DEFAULT} in {tmp_path}: whole, then cut by SIGKILL after checkpoint 10 and resumed")
    assert verdict.startswith("No difference: the state of step 20 (bit for bit), every metrics.jsonl value")
    held = (tmp_path / "cut" / HELD).read_text()  # the cut run held past its checkpoint, until its SIGKILL
    assert held.startswith("held after step ") and int(held.split()[-1]) > 10


def test_data_without_a_position_is_the_one_line_it_reports(tmp_path):
    (tmp_path / "plain_data.py").write_text(PLAIN_GENERATOR)
    base = tiny_config(tmp_path, steps=20)
    (tmp_path / "generator.py").write_text(GENERATOR_CONFIG.replace("BASE", repr(str(base))))
    result = check_resume("--config", tmp_path / "generator.py", "--workdir", tmp_path / "runs")
    assert result.returncode == 1, result.stdout + result.stderr[-3000:]
    header, line = result.stdout.strip().splitlines()
    assert header.startswith(HEADER)
    assert line.startswith("data: the training data has no position (its iterator has no get_state()/set_state()), "
                           "so the resumed run read other batches from step 11 on than the whole run; give it one")
    assert line.endswith("other values differ")


def test_data_drawn_without_a_seed_is_said_in_one_line_and_the_check_s_own_directory_is_removed(tmp_path):
    (tmp_path / "unseeded_data.py").write_text(UNSEEDED_DATA)
    config = tmp_path / "unseeded.py"
    tiny = tiny_config(tmp_path, steps=4).read_text()
    config.write_text(tiny.replace("jaxmon.datasets:digits", "unseeded_data:load"))
    temporary, env = scratch(tmp_path)
    result = check_resume("--config", config, "--steps", 4, env=env)
    assert result.returncode == 1, result.stdout + result.stderr[-3000:]
    header, *found, last = result.stdout.strip().splitlines()
    assert header.startswith(f"{HEADER.replace('20', '4')}{config} in {temporary}/jaxmon-check-resume-")
    assert "(removed at the end; --workdir DIR keeps the runs)" in header
    assert any(line.startswith("metrics.jsonl loss at step 1:") for line in found), found
    assert last.startswith("not deterministic: the runs differ from step 1 on, before the cut at checkpoint 2, where "
                           "both ran alike: the data or the init draws random numbers without a seed"), last
    assert "`seed` seeds the init and the data's shuffle" in last and "data.seed" in last, last
    assert last.endswith(f"the {len(found)} differences above follow from it"), last
    assert not result.stderr.strip(), result.stderr
    assert list(temporary.iterdir()) == []  # the runs went with the check


def test_the_check_s_own_directory_is_removed_after_a_check_that_passes_and_after_ctrl_c(tmp_path):
    config = tiny_config(tmp_path, steps=4)
    temporary, env = scratch(tmp_path)
    result = check_resume("--config", config, "--steps", 4, env=env)
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1].startswith("No difference:")
    assert list(temporary.iterdir()) == []
    check = warm_processes.popen([sys.executable, "-m", "jaxmon", "check", "--resume", "--config", str(config),
                                  "--steps", "4"], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 text=True)
    try:
        deadline = time.monotonic() + 120
        while not any((run / "whole").exists() for run in temporary.iterdir()):  # the first run has begun
            assert check.poll() is None and time.monotonic() < deadline, check.communicate()
            time.sleep(0.05)
        check.send_signal(signal.SIGINT)
        out, err = check.communicate(timeout=60)
    finally:
        check.kill()
    assert check.returncode == 130, err
    assert err.strip().splitlines()[-1].startswith("jaxmon check: Stopped by Ctrl-C"), err
    assert list(temporary.iterdir()) == []


@pytest.mark.slow
def test_a_run_of_two_processes_resumed_on_one_is_the_whole_run_to_float_rounding(tmp_path):
    result = check_resume("--config", DEFAULT, "--workdir", tmp_path, "--processes", 2, "--resume-processes", 1)
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    header, verdict = result.stdout.strip().splitlines()
    assert header.endswith("resumed on 1 process")
    assert verdict.startswith("No difference: the state of step 20 (to rel. 1e-05: on another number of processes")


@pytest.mark.parametrize("args, words", [
    (["--steps", "1"], "--steps 1: the check cuts the run at a checkpoint between its first and last step; give 2 "
                       "or more"),
    (["--processes", "0"], "--processes 0: give a number of processes, at least 1"),
])
def test_a_bad_option_exits_2_in_one_line(tmp_path, args, words):
    result = check_resume("--config", DEFAULT, "--workdir", tmp_path, *args)
    assert result.returncode == 2 and result.stderr.strip() == f"jaxmon check: {words}.", result.stderr
