"""`jaxmon sweep`: a grid of config values, one `jaxmon train` per point in a workdir of
its own; a rerun trains only the unfinished points; a table and one plot at the end."""

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest
from helpers import DEFAULT, ROOT, cpu_env

import jaxmon as jm
from jaxmon._cli.sweep import device_shares, grid_points, listed_points, point_name, random_points

LM_SHORT = ["--config.steps=4", "--config.model.num_layers=1", "--config.hooks.1.every_n_steps=4",
            "--config.session.save_checkpoint_steps=4", "--config.optimizer.learning_rate.decay_steps=4",
            "--config.optimizer.learning_rate.warmup_steps=1"]


def sweep(*args, **popen):
    return subprocess.Popen([sys.executable, "-m", "jaxmon", "sweep", *map(str, args)], cwd=ROOT, env=cpu_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen)


def test_the_points_are_every_combination_of_the_grids_values():
    assert grid_points(["seed=0,1", "optimizer.learning_rate=1e-3, 3e-3"]) == [
        {"seed": "0", "optimizer.learning_rate": "1e-3"}, {"seed": "0", "optimizer.learning_rate": "3e-3"},
        {"seed": "1", "optimizer.learning_rate": "1e-3"}, {"seed": "1", "optimizer.learning_rate": "3e-3"}]
    assert point_name({"model.name": "jaxmon.models:MLP", "seed": "1"}) == "model.name=jaxmon.models_MLP,seed=1"
    for bad in ("seed", "seed=", "=1,2", "seed=1,,2"):
        with pytest.raises(ValueError, match="give a config key and its values"):
            grid_points([bad])


def test_listed_points_are_taken_as_given_and_a_bad_one_names_the_form():
    assert listed_points(["seed=0 optimizer.learning_rate=1e-3", "seed=5"]) == [
        {"seed": "0", "optimizer.learning_rate": "1e-3"}, {"seed": "5"}]
    for bad, match in ((["seed"], "space-separated"), (["seed=1 seed=2"], "gives seed twice"),
                       (["seed=1", "seed=1"], "give the point seed=1")):
        with pytest.raises(ValueError, match=match):
            listed_points(bad)


def test_random_points_are_drawn_from_the_seed_and_the_same_on_a_rerun():
    grid = ["seed=0,1,2,3", "model.features=[16],[32]"]
    drawn = random_points(5, grid, [], seed=7)
    assert drawn == random_points(5, grid, [], seed=7) != random_points(5, grid, [], seed=8)
    assert len({tuple(p.items()) for p in drawn}) == 5 and all(p in grid_points(grid) for p in drawn)  # no repeats
    ranged = random_points(20, ["seed=0,1"], ["optimizer.learning_rate=1e-4,1e-2"], seed=0)
    rates = [float(p["optimizer.learning_rate"]) for p in ranged]
    assert all(1e-4 <= r <= 1e-2 for r in rates) and min(rates) < 1e-3 < max(rates)  # spread over the decades
    assert {p["seed"] for p in ranged} == {"0", "1"}
    for args, match in (((9, grid, []), "only 8 points"), ((2, [], []), "at least one"),
                        ((2, [], ["optimizer.learning_rate=1e-2,1e-4"]), "LOW < HIGH"),
                        ((0, grid, []), "at least 1"), ((2, ["seed=0,1"], ["seed=1,2"]), "each key once")):
        with pytest.raises(ValueError, match=match):
            random_points(*args, seed=0)


def test_points_at_once_share_the_visible_gpus_out_and_never_share_one():
    eight = [str(i) for i in range(8)]
    assert device_shares(1, eight) == [None] and device_shares(2, []) == [None, None]  # the CPU: processes share it
    assert device_shares(2, eight) == ["0,1,2,3", "4,5,6,7"] and device_shares(3, eight[:4]) == ["0", "1", "2"]
    assert device_shares(2, ["4", "5", "6", "7"]) == ["4,5", "6,7"]  # CUDA_VISIBLE_DEVICES=4,5,6,7: those
    with pytest.raises(ValueError, match="--parallel 2 or fewer"):
        device_shares(3, ["0", "1"])


def test_a_larger_random_draw_keeps_the_points_of_a_smaller_one_and_never_repeats_one():
    grid, ranges = ["seed=0,1,2,3"], ["optimizer.learning_rate=1e-3,3e-3"]
    five = random_points(5, grid, ranges, seed=1)
    assert random_points(3, grid, ranges, seed=1) == five[:3]
    assert sorted(p["seed"] for p in five[:4]) == ["0", "1", "2", "3"]  # every grid value before one twice
    many = random_points(60, [], ranges, seed=0)  # 3 significant digits: rounding alone would repeat some
    assert len({point_name(p) for p in many}) == 60
    steps = random_points(20, [], ["steps=10,1000"], seed=0, ints=frozenset({"steps"}))
    assert all(p["steps"].isdigit() and 10 <= int(p["steps"]) <= 1000 for p in steps)


@pytest.mark.parametrize("args, line", [
    (["--point", "seed=1", "--grid", "seed=0,1"], "give one of the two"),
    (["--log-uniform", "optimizer.learning_rate=1e-4,1e-2"], "add --random N"),
    (["--random", "3"], "give at least one"),
    ([], "give the points"),
    (["--grid", "seed=0,1", "--parallel", "0"], "at least 1"),
    (["--grid", "seed=0,1", "--seed", "3"], "--seed is for random draws: add --random N"),
    (["--grid", "seed=0,1,0"], "gives 0 twice"),
    (["--point", "seed=1", "--point", "seed=1"], "the point seed=1"),
])
def test_points_given_in_no_form_or_two_exit_2_with_one_line(tmp_path, args, line):
    done = sweep("--config", DEFAULT, "--workdir", tmp_path / "s", *args)
    out, err = done.communicate(timeout=120)
    assert done.returncode == 2 and len(err.strip().splitlines()) == 1 and line in err, err
    assert not (tmp_path / "s").exists()


@pytest.mark.slow
def test_a_point_that_fails_ends_the_sweep_with_its_code_after_its_neighbour_and_starts_no_other(tmp_path):
    # The neighbour trains 300 steps, far more than the failing point takes to fail, so that on a
    # loaded machine too it ends after that point's failure: no slot frees for the third.
    done = sweep("--config", DEFAULT, "--workdir", tmp_path, "--parallel", 2, "--config.steps=30",
                 "--point", "optimizer.learning_rate=1e30 seed=0", "--point", "optimizer.learning_rate=0.001 steps=300",
                 "--point", "optimizer.learning_rate=0.001 seed=1")
    out, err = done.communicate(timeout=600)  # a point still queued once the others ended: the sweep ends too
    assert done.returncode == 1, err[-3000:]  # a non-finite loss: `jaxmon train`'s exit 1
    assert "the point optimizer.learning_rate=1e30,seed=0 failed with exit code 1" in err
    assert out.count(": training") == 2 and not (tmp_path / "optimizer.learning_rate=0.001,seed=1").exists()
    assert jm.latest_checkpoint_step(tmp_path / "optimizer.learning_rate=0.001,steps=300") == 300  # the neighbour
    assert not (tmp_path / "sweep.json").exists()


@pytest.mark.slow
def test_a_random_draw_trained_two_at_a_time_writes_each_log_and_a_rerun_trains_nothing(tmp_path):
    args = ["--config", DEFAULT, "--workdir", tmp_path, "--random", "3", "--grid", "seed=0,1",
            "--log-uniform", "optimizer.learning_rate=1e-3,1e-2", "--seed", "3", "--parallel", "2",
            "--config.steps=40"]
    done = sweep(*args)
    out, err = done.communicate(timeout=600)
    assert done.returncode == 0, err[-3000:]
    rows = json.loads((tmp_path / "sweep.json").read_text())
    drawn = random_points(3, ["seed=0,1"], ["optimizer.learning_rate=1e-3,1e-2"], seed=3)
    assert [row["point"] for row in rows] == drawn
    times = []  # each point's first and last record
    for row in rows:
        assert jm.latest_checkpoint_step(row["workdir"]) == 40 and "eval/accuracy" in row["metrics"]
        log = (pathlib.Path(row["workdir"]) / "train.log").read_text()
        assert log.startswith("step 40: test accuracy") and row["workdir"] in log, log[-2000:]
        lines = (pathlib.Path(row["workdir"]) / "metrics.jsonl").read_text().splitlines()
        records = [r for r in map(json.loads, lines) if "wall_time" in r]
        times.append((records[0]["wall_time"], records[-1]["wall_time"]))
    assert times[1][0] < times[0][1] and times[0][0] < times[1][1]  # the first two trained at once
    assert out.count(": training (output in ") == 3
    again = sweep(*args)
    out, err = again.communicate(timeout=300)
    assert again.returncode == 0 and out.count("finished already") == 3 and "training" not in out, err[-2000:]


def test_a_grid_of_an_unknown_key_exits_2_with_one_line_before_any_training(tmp_path):
    done = sweep("--config", DEFAULT, "--workdir", tmp_path / "s", "--grid", "optimizer.learnig_rate=1e-3,3e-3")
    out, err = done.communicate(timeout=120)
    assert done.returncode == 2 and len(err.strip().splitlines()) == 1, err
    assert "Did you mean 'optimizer.learning_rate'?" in err and not list((tmp_path / "s").glob("*=*"))


@pytest.mark.slow
def test_a_2_by_2_grid_of_the_lm_config_writes_4_runs_a_table_and_one_plot(tmp_path):
    done = sweep("--config", ROOT / "configs" / "lm.py", "--workdir", tmp_path, "--grid", "seed=0,1",
                 "--grid", "optimizer.learning_rate.peak_value=0.003,0.01", *LM_SHORT)
    out, err = done.communicate(timeout=600)
    assert done.returncode == 0, err[-3000:]
    rows = json.loads((tmp_path / "sweep.json").read_text())
    assert [row["point"] for row in rows] == grid_points(["seed=0,1", "optimizer.learning_rate.peak_value=0.003,0.01"])
    for row in rows:
        assert jm.latest_checkpoint_step(row["workdir"]) == 4 and os.path.dirname(row["workdir"]) == str(tmp_path)
        assert set(row["metrics"]) >= {"eval/loss", "eval/perplexity", "eval/accuracy"}, row
    table = out.strip().splitlines()
    header = next(i for i, line in enumerate(table) if line.startswith("seed  optimizer.learning_rate.peak_value"))
    assert "eval/loss" in table[header] and len(table[header + 1:header + 5]) == 4
    assert not {"loss_sum", "tokens", "correct"} & set(table[header].split())  # the sums the metrics divide
    for line, row in zip(table[header + 1:header + 5], rows, strict=True):
        assert line.split()[:2] == list(row["point"].values())
        assert f"{row['metrics']['eval/loss']:.6g}" in line.split()
    assert (tmp_path / "sweep.png").stat().st_size > 10_000


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a point's process ends with the sweep's on Linux")
def test_a_sweep_killed_midway_and_run_again_trains_only_the_unfinished_points(tmp_path):
    args = ["--config", DEFAULT, "--workdir", tmp_path, "--grid", "seed=0,1,2", "--config.steps=100"]
    first = sweep(*args, start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while jm.latest_checkpoint_step(tmp_path / "seed=1") is None:  # point 1 finished, point 2 started
            assert first.poll() is None, first.communicate()
            assert time.monotonic() < deadline, "the second point never started"
            time.sleep(0.05)
        os.killpg(first.pid, signal.SIGKILL)
    finally:
        first.communicate(timeout=60)
    assert jm.latest_checkpoint_step(tmp_path / "seed=0") == 100
    assert jm.latest_checkpoint_step(tmp_path / "seed=1") < 100 and not (tmp_path / "seed=2").exists()
    finished = (tmp_path / "seed=0" / "metrics.jsonl").stat().st_mtime_ns
    rerun = sweep(*args)
    out, err = rerun.communicate(timeout=600)
    assert rerun.returncode == 0, err[-3000:]
    assert "[1/3] seed=0: finished already" in out
    assert "[2/3] seed=1: training" in out and "[3/3] seed=2: training" in out
    assert (tmp_path / "seed=0" / "metrics.jsonl").stat().st_mtime_ns == finished  # not trained again
    assert all(jm.latest_checkpoint_step(tmp_path / f"seed={seed}") == 100 for seed in range(3))
    assert len(json.loads((tmp_path / "sweep.json").read_text())) == 3
