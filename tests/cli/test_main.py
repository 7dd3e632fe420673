"""The `jaxmon` command, run as a user runs it: a subprocess per call.

The default experiment (what `make train` runs) is trained once for the module; the
other commands read that run back.
"""

import json
import os
import pathlib
import re
import shutil
import subprocess
import sysconfig

import pytest
from helpers import DEFAULT, ROOT, run_jaxmon, signal_between_saves

import jaxmon as jm

RESULT = re.compile(r"step (\d+): test accuracy ([\d.]+), loss ([\d.]+)  \((.+)\)")


def jaxmon(*args, timeout=240, **env):
    env = dict(os.environ, PYTHONUNBUFFERED="1", **env)
    return run_jaxmon(args, cwd=ROOT, env=env, timeout=timeout)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """The default experiment trained in a fresh directory, as `make train` does."""
    workdir = tmp_path_factory.mktemp("runs") / "default"
    result = jaxmon("train", "--config", DEFAULT, "--workdir", workdir)
    assert result.returncode == 0, result.stderr[-3000:]
    return workdir, result


@pytest.mark.slow
def test_the_default_experiment_reaches_95_percent_test_accuracy(run):
    workdir, result = run
    match = RESULT.fullmatch(result.stdout.strip().splitlines()[-1])
    assert match, result.stdout[-500:]
    assert int(match[1]) == 1500 and float(match[2]) >= 0.95
    assert "Resumed" not in result.stdout
    # Checkpoints every 500 steps (3 kept), event files and metrics.jsonl in the run's directory.
    assert jm.latest_checkpoint_step(workdir) == 1500
    assert sorted(int(p.name) for p in workdir.iterdir() if p.name.isdigit()) == [500, 1000, 1500]
    assert list(workdir.glob("events.out.tfevents.*"))
    restored = jm.restore_checkpoint(workdir)
    assert restored.step == 1500
    assert restored.meta["config"] == jm.load_config(DEFAULT)  # the config is stored with the checkpoint
    # The printed accuracy is the saved model's: evaluate the restored parameters on the test split.
    test = jm.datasets.digits("test")
    model = jm.models.CNN(channels=(16, 32), features=(64,), num_outputs=10)
    logits = model.apply({"params": restored.state["params"]}, test["x"])
    assert abs(float((logits.argmax(-1) == test["y"]).mean()) - float(match[2])) < 1e-4


def test_the_logs_show_evaluations_checkpoints_and_the_step_rate(run):
    _, result = run
    log = result.stderr
    for step in (250, 500, 750, 1000, 1250, 1500):
        assert re.search(rf"eval at step {step}: accuracy = [\d.]+, loss = [\d.]+", log), step
    assert "Saving checkpoint 1500" in log and "global_step/sec" in log


def test_the_event_file_has_scalars_eval_metrics_and_the_config(run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    workdir, _ = run
    events = EventAccumulator(str(workdir), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    scalars = events.Tags()["scalars"]
    assert {"loss", "accuracy", "eval/loss", "eval/accuracy", "global_step/sec"} <= set(scalars)
    assert [e.step for e in events.Scalars("eval/accuracy")][-1] == 1500
    assert [e.step for e in events.Scalars("loss")][:3] == [1, 50, 100]  # step 1, then every 50 steps
    texts = events.Tags()["tensors"]
    assert any(tag.startswith("config") for tag in texts), texts


def test_a_second_train_resumes_and_says_so(run):
    workdir, first = run
    again = jaxmon("train", "--config", DEFAULT, "--workdir", workdir)
    assert again.returncode == 0, again.stderr[-2000:]
    assert f"Resumed from step 1500 in {workdir}; already at the last step (1500): evaluating only." in again.stdout
    assert "Restored step 1500" in again.stderr
    # Nothing retrained: the same result line, and no checkpoint written beyond 1500.
    assert again.stdout.strip().splitlines()[-1] == first.stdout.strip().splitlines()[-1]
    assert jm.latest_checkpoint_step(workdir) == 1500


EXIT_PROBE = """
import atexit, os, threading, time
import jaxmon as jm


class ExitProbe(jm.Hook):
    # At the end: a thread (not a daemon) that writes a file half a second later, and an
    # exit function that writes whether that file was there when it ran.

    def __init__(self, directory):
        self.directory = directory

    def end(self, session):
        def late():
            time.sleep(0.5)
            with open(os.path.join(self.directory, "thread"), "w") as f:
                f.write("done")

        def at_exit():
            with open(os.path.join(self.directory, "atexit"), "w") as f:
                f.write(str(os.path.exists(os.path.join(self.directory, "thread"))))

        threading.Thread(target=late).start()
        atexit.register(at_exit)
"""


def test_a_finished_run_ends_as_python_ends_joining_threads_then_running_exit_functions(tmp_path):
    """The command ends without Python's teardown of every module, but as Python would
    otherwise: a thread still running is waited for, then the exit functions run."""
    (tmp_path / "probe.py").write_text(EXIT_PROBE)
    (tmp_path / "config.py").write_text(f"""
import sys
sys.path.insert(0, {str(ROOT / "configs")!r})
import default

def get_config():
    config = default.get_config()
    config["hooks"].append({{"name": "probe:ExitProbe", "directory": {str(tmp_path)!r}}})
    return config
""")
    result = jaxmon("train", "--config", tmp_path / "config.py", "--workdir", tmp_path / "run", "--config.steps=5",
                    "--config.hooks.1.every_n_steps=5")
    assert result.returncode == 0, result.stderr[-2000:]
    assert RESULT.fullmatch(result.stdout.strip().splitlines()[-1])[1] == "5"
    assert (tmp_path / "thread").read_text() == "done"
    assert (tmp_path / "atexit").read_text() == "True"  # after the thread had ended


def test_overrides_continue_the_run_with_new_settings(run, tmp_path):
    workdir, _ = run
    longer = tmp_path / "longer"
    # Start from a copy of the finished run so the other tests keep reading the original.
    subprocess.run(["cp", "-r", str(workdir), str(longer)], check=True)
    result = jaxmon("train", "--config", DEFAULT, "--workdir", longer, "--config.steps=1520",
                    "--config.session.save_checkpoint_steps=10", "--config.hooks.1.every_n_steps=10", "--quiet")
    assert result.returncode == 0, result.stderr[-2000:]
    assert "Resumed from step 1500 in" in result.stdout and "training on to step 1520" in result.stdout
    assert "Changed since step 1500: steps: 1500 -> 1520" in result.stdout
    assert RESULT.fullmatch(result.stdout.strip().splitlines()[-1])[1] == "1520"
    assert "eval at step" not in result.stderr  # --quiet: warnings only
    assert [int(p.name) for p in sorted(longer.iterdir(), key=lambda p: p.name) if p.name.isdigit()][-2:] == [
        1510, 1520]
    config = jm.restore_checkpoint(longer).meta["config"]
    assert config["steps"] == 1520 and config["session"]["save_checkpoint_steps"] == 10


@pytest.mark.slow
def test_a_restart_finds_the_step_compiled_in_the_workdirs_compilation_cache(tmp_path):
    workdir = tmp_path / "run"

    def train(steps, *flags):
        result = jaxmon("train", "--config", DEFAULT, "--workdir", workdir, f"--config.steps={steps}", *flags,
                        "--config.hooks.1.every_n_steps=10", "--config.model.channels=[4]",  # compiles in half the time
                        "--config.model.features=[16]", JAX_DEBUG_LOG_MODULES="jax._src.compiler",
                        JAX_COMPILATION_CACHE_DIR="")  # not the suite's cache (conftest.py): the workdir's
        assert result.returncode == 0, result.stderr[-2000:]
        assert jm.latest_checkpoint_step(workdir) == steps
        assert re.search(r"Compiled the step for runs of 1 step with 0 fetched values in [\d.]+ s\.", result.stderr)
        return re.findall(r"(cache hit|CACHE MISS) for 'jit_variant'", result.stderr)  # JAX's debug log

    assert train(10) == ["CACHE MISS"]  # fresh: compiled, and kept in WORKDIR/compilation_cache
    assert any(path.name.startswith("jit_variant-") for path in (workdir / "compilation_cache").iterdir())
    assert train(20) == ["cache hit"]  # the restored state runs the program the fresh one compiled
    assert "cache hit" not in "".join(train(30, "--no_compilation_cache"))  # compiled again


def test_an_unknown_override_exits_non_zero_naming_the_key(tmp_path):
    result = jaxmon("train", "--config", DEFAULT, "--workdir", tmp_path / "w", "--config.no_such_key=1")
    assert result.returncode != 0
    assert "no_such_key" in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "w").exists()  # nothing started


def test_a_mistyped_override_names_the_key_its_type_and_the_nearest_key(tmp_path):
    result = jaxmon("train", "--config", DEFAULT, "--workdir", tmp_path, "--config.optimizer.learnig_rate=1e-3",
                    "--config.steps=many")
    assert result.returncode == 2
    assert "Did you mean 'optimizer.learning_rate'?" in result.stderr
    result = jaxmon("train", "--config", DEFAULT, "--workdir", tmp_path, "--config.steps=many")
    assert result.returncode == 2 and "'steps' is an int (1500); the override 'many' is text" in result.stderr


@pytest.mark.parametrize("overrides, words", [
    (["--config.optimizer.learning_rate.name=linear_schedule"],
     ["jaxmon train: optimizer.learning_rate: ", "unexpected keyword argument 'peak_value'",
      "optax.linear_schedule takes init_value, end_value, transition_steps, transition_begin",
      "--config.optimizer.learning_rate=\"{'name': 'linear_schedule', ...}\""]),
    (["--config.steps=0"], ["jaxmon train: Config key 'steps' is the last step to train to, at least 1; got 0. "
                            "Pass e.g. --config.steps=100."]),
], ids=["a-schedule-switched-key-by-key", "steps-0"])
def test_a_refused_config_value_exits_2_with_one_line_naming_the_key_and_the_fix(tmp_path, overrides, words):
    result = jaxmon("train", "--config", ROOT / "configs" / "lm.py", "--workdir", tmp_path / "w", *overrides)
    assert result.returncode == 2, result.stderr[-3000:]
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr, result.stderr
    for word in words:
        assert word in result.stderr, (word, result.stderr)


def test_a_schedule_switched_in_one_override_trains(tmp_path):
    schedule = "{'name': 'linear_schedule', 'init_value': 0.003, 'end_value': 0.0, 'transition_steps': 4}"
    result = jaxmon("train", "--config", ROOT / "configs" / "lm.py", "--workdir", tmp_path, "--config.steps=4",
                    "--quiet", "--config.model.num_layers=1", f"--config.optimizer.learning_rate={schedule}")
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1].startswith("step 4: "), result.stdout[-2000:]


@pytest.mark.slow
def test_a_diverging_lm_run_is_stopped_within_20_steps_of_its_blow_up_with_one_line(tmp_path):
    """The trial's learning rate of 30 (the loss 4.8 -> 850 in 4 steps, inside the spike
    rule's warm-up): configs/lm.py's NanHook stops it, before its evaluation at step 20."""
    result = jaxmon("train", "--config", ROOT / "configs" / "lm.py", "--workdir", tmp_path, "--config.steps=100",
                    "--config.optimizer.learning_rate.peak_value=30", "--config.model.num_layers=1",
                    "--config.hooks.1.every_n_steps=20")
    assert result.returncode == 1, result.stderr[-3000:]
    last = result.stderr.strip().splitlines()[-1]
    found = re.fullmatch(r"jaxmon train: NanLossDuringTrainingError: Spike in the loss during training: 'loss' = "
                         r"[\d.]{1,7} at step (\d+)\. .*\(raised in NanHook\(.*\)\.after_read at step (\d+)\)", last)
    assert found and int(found[2]) - int(found[1]) <= 20, last
    assert "eval at step" not in result.stdout + result.stderr
    assert jm.latest_checkpoint_step(tmp_path) == 0  # the bad state is never saved


def test_inspect_lists_checkpoints_metrics_and_config(run):
    workdir, _ = run
    text = jaxmon("inspect", workdir)
    assert text.returncode == 0, text.stderr
    lines = text.stdout.splitlines()
    assert lines[0] == f"run {workdir}" and lines[1] == "checkpoints (3):"
    for step in (500, 1000, 1500):
        assert re.search(rf"^  step +{step} +[\d.]+ KB  \d{{4}}-\d\d-\d\dT", text.stdout, re.M), step
    assert re.search(r"^  eval/accuracy +0\.9[5-9]\d*  \(step 1500\)$", text.stdout, re.M)
    assert '"source": "jaxmon.datasets:digits"' in text.stdout
    info = json.loads(jaxmon("inspect", workdir, "--json").stdout)
    assert [c["step"] for c in info["checkpoints"]] == [500, 1000, 1500]
    assert all(c["bytes"] > 10_000 for c in info["checkpoints"])
    assert info["metrics"]["eval/accuracy"][0] == 1500 and info["config"] == jm.load_config(DEFAULT)


def test_inspect_verify_finds_the_changed_and_the_unsealed_checkpoints_and_exits_1(run, tmp_path):
    workdir = tmp_path / "run"
    shutil.copytree(run[0], workdir)
    assert jaxmon("inspect", workdir, "--verify").returncode == 0
    assert re.findall(r"(sealed|unsealed)$", jaxmon("inspect", workdir).stdout, re.M) == ["sealed"] * 3
    data = max((p for p in (workdir / "1000").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    with open(data, "r+b") as f:  # one flipped byte
        f.seek(data.stat().st_size // 2)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0xFF]))
    os.remove(workdir / "1500" / "jaxmon-integrity.json")
    result = jaxmon("inspect", workdir, "--verify")
    assert result.returncode == 1, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == f"run {workdir}: 3 checkpoints re-read"
    assert re.fullmatch(r"  step +500  sound +\d+ files, \d+ bytes, each as its jaxmon-integrity.json records",
                        lines[1]), lines[1]
    name = re.escape(str(data.relative_to(workdir / "1000")))
    assert re.fullmatch(rf"  step +1000  changed +{name} changed after it was written \(crc32 [0-9a-f]{{8}} != "
                        r"[0-9a-f]{8} recorded\): a restore refuses it", lines[2]), lines[2]
    assert lines[3] == ("  step     1500  unsealed  no jaxmon-integrity.json, and its run seals every checkpoint: a "
                        "restore refuses it")
    verdicts = json.loads(jaxmon("inspect", workdir, "--verify", "--json").stdout)["checkpoints"]
    assert [v["state"] for v in verdicts] == ["sound", "changed", "unsealed"]


def test_inspect_of_a_missing_directory_is_a_clear_error(tmp_path):
    result = jaxmon("inspect", tmp_path / "nope")
    assert result.returncode == 2 and "No run directory" in result.stderr and "Traceback" not in result.stderr


@pytest.fixture(scope="module")
def plotted(run, tmp_path_factory):
    """`jaxmon plot` of the default experiment's run: the PNG's path and the command's result."""
    out = tmp_path_factory.mktemp("plot") / "curves.png"
    return out, jaxmon("plot", run[0], "--out", out)


def test_plot_writes_a_png_of_every_scalar(run, plotted, tmp_path):
    workdir, _ = run
    out, result = plotted
    assert result.returncode == 0, result.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 20_000
    assert "eval/accuracy" in result.stdout and "loss" in result.stdout
    only = jaxmon("plot", workdir, "--out", tmp_path / "loss.png", "--tags", "loss")
    assert only.returncode == 0 and only.stdout.endswith("(1 scalars: loss)\n")
    missing = jaxmon("plot", workdir, "--out", tmp_path / "x.png", "--tags", "nope")
    assert missing.returncode == 2 and "no scalar 'nope'" in missing.stderr


def test_plot_of_two_runs_writes_one_png_with_both(run, plotted, tmp_path):
    workdir, _ = run
    other = tmp_path / "halved"  # a second run: the same curves, every loss halved
    other.mkdir()
    with open(workdir / "metrics.jsonl") as source, open(other / "metrics.jsonl", "w") as target:
        for line in source:
            record = json.loads(line)
            target.write(json.dumps({k: v / 2 if k.endswith("loss") else v for k, v in record.items()}) + "\n")
    out = tmp_path / "both.png"
    result = jaxmon("plot", workdir, other, "--out", out)
    assert result.returncode == 0, result.stderr
    import matplotlib.image

    assert result.stdout.startswith(f"wrote {out} (2 runs, ") and "eval/accuracy" in result.stdout
    one, plot = plotted  # the first run alone
    assert plot.returncode == 0, plot.stderr
    image, single = matplotlib.image.imread(out), matplotlib.image.imread(one)  # both open
    assert image.ndim == 3 and image.shape[1] >= 900 and image.shape[0] >= 300
    assert image.shape == single.shape  # the same panels, each run's lines in them
    assert out.stat().st_size > one.stat().st_size  # more lines, and a legend


def test_plot_without_metrics_is_a_clear_error(tmp_path):
    result = jaxmon("plot", tmp_path)
    assert result.returncode == 2 and "no metrics.jsonl" in result.stderr


@pytest.mark.parametrize("args, words", [
    (["--help"], ["jaxmon train --config", "inspect", "plot"]),
    (["train", "--help"], ["--config FILE", "--workdir DIR", "--config.KEY=VALUE", "resumes"]),
    (["inspect", "--help"], ["checkpoints", "--json"]),
    (["plot", "--help"], ["PNG", "jaxmon[plot]", "--tags"]),
])
def test_help_explains_each_command(args, words):
    result = jaxmon(*args)
    assert result.returncode == 0
    for word in words:
        assert word in result.stdout, word


def test_the_console_script_is_installed():
    script = pathlib.Path(sysconfig.get_path("scripts")) / "jaxmon"  # the venv's bin/, or /usr/local/bin
    result = subprocess.run([str(script), "--help"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and "usage: jaxmon" in result.stdout


def test_changing_what_the_checkpoints_depend_on_is_refused(run):
    workdir, _ = run
    result = jaxmon("train", "--config", DEFAULT, "--workdir", workdir, "--config.model.features=[32]",
                    "--config.seed", "3")  # the absl habit: a space instead of '='
    assert result.returncode == 2 and "Traceback" not in result.stderr
    for words in ("latest step 1500", "model.features.0: 64 -> 32", "seed: 0 -> 3", "--config.warm_start="):
        assert words in result.stderr, words
    assert jm.latest_checkpoint_step(workdir) == 1500


def test_sigterm_saves_stops_and_exits_143_and_the_same_command_resumes(tmp_path):
    import signal

    workdir = tmp_path / "run"
    result = signal_between_saves(DEFAULT, workdir, signal.SIGTERM, ROOT)
    assert result.returncode == 143, result.stderr[-2000:]
    stopped = re.fullmatch(r"jaxmon train: Stopped by SIGTERM at step (\d+); checkpoint \1 is saved: run the same "
                           r"command to resume\.", result.stderr.strip().splitlines()[-1])
    assert stopped and int(stopped[1]) > 0 and "test accuracy" not in result.stdout
    assert "Stopped" not in result.stdout  # said once, on stderr
    assert jm.latest_checkpoint_step(workdir) == int(stopped[1])  # saved at the step it stopped


def test_inspect_and_plot_skip_a_line_cut_off_by_a_killed_writer(run, tmp_path):
    workdir, _ = run
    copy = tmp_path / "copy"
    subprocess.run(["cp", "-r", str(workdir), str(copy)], check=True)
    with open(copy / "metrics.jsonl", "a") as file:
        file.write('{"step": 1501, "loss": 1.')
    result = jaxmon("inspect", copy)
    assert result.returncode == 0 and "skipped 1 unreadable line" in result.stderr
    assert re.search(r"^  loss +[\d.e-]+  \(step 1500\)$", result.stdout, re.M)  # the last of every 50 steps
    plot = jaxmon("plot", copy, "--out", tmp_path / "new" / "dir" / "m.png")
    assert plot.returncode == 0 and (tmp_path / "new" / "dir" / "m.png").exists()


@pytest.mark.parametrize("runs", [1, 3])
def test_the_plots_title_stands_clear_of_its_panels_and_within_the_figure(runs):
    """One panel (a figure 450 px wide) of three runs whose paths make a title twice as wide."""
    from jaxmon._cli.runs import draw, plot_plan

    series = {"loss": ([1, 2, 3], [2.0, 1.0, 0.5]), "eval/loss": ([3], [0.7])}
    figure = draw(plot_plan({f"run{i}": series for i in range(runs)}),
                  ", ".join(["/tmp/a/long/path/to/the/directory/of/a/run"] * runs))
    figure.canvas.draw()
    renderer = figure.canvas.get_renderer()
    title = figure._suptitle.get_window_extent(renderer)  # noqa: SLF001 - matplotlib keeps the title there
    panels = [ax.title.get_window_extent(renderer) for ax in figure.axes if ax.get_visible()]
    assert panels and all(panel.y1 <= title.y0 for panel in panels), (title, panels)
    assert 0 <= title.x0 and title.x1 <= figure.bbox.width and title.y1 <= figure.bbox.height, title
