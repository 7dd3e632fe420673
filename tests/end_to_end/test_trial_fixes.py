"""What users met on their first runs, each read back from real artefacts: an early-stopped
run resumed, data without a position resumed, `jaxmon plot`'s axes and `jaxmon inspect`'s
kept-best checkpoints."""

from __future__ import annotations

import json
import logging

import jax.numpy as jnp
import numpy as np
import pytest
from helpers import Counter, count_step, run_loop, warnings_of, zero

import jaxmon as jm
from jaxmon._checkpoints.manager import complete_steps
from jaxmon._cli import main as _cli

matplotlib = pytest.importorskip("matplotlib")
matplotlib.use("Agg")
import matplotlib.image  # noqa: E402
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.colors import to_hex  # noqa: E402

# The loss after each step: it improves up to step 2 and never again.
LOSSES = jnp.asarray([9.0, 5.0, 3.0, 3.0, 3.0, 3.0, 3.0, 3.0, 3.0, 3.0, 3.0, 3.0], jnp.float32)


def plateau_step(state, batch):
    state = state + 1
    return state, {"loss": LOSSES[state]}


def early_stopped_session(directory, patience=2):
    stop = jm.EarlyStoppingHook("loss", patience=patience, every_n_steps=1)
    hooks = [jm.CheckpointSaverHook(directory, save_steps=100), stop, jm.StopAtStepHook(last_step=10)]
    return stop, jm.MonitoredSession(plateau_step, zero, hooks=hooks)


# -- an early-stopped run stays stopped ------------------------------------------------------


def test_a_rerun_of_an_early_stopped_run_stops_at_once_and_saves_nothing(tmp_path, caplog):
    stop, sess = early_stopped_session(tmp_path)
    with sess:
        run_loop(sess)
    assert sess.step == 4 and stop.stopped_step == 4  # checks at 3 and 4 without improvement
    assert complete_steps(tmp_path) == [0, 4]
    saved = jm.restore_checkpoint(tmp_path).meta["hooks"]["EarlyStoppingHook"]
    assert saved["stopped_step"] == 4 and saved["waited"] == 2  # the checkpoint at the stop holds the stop

    with caplog.at_level(logging.INFO, logger="jaxmon"):
        stop, sess = early_stopped_session(tmp_path)
        with sess:
            assert sess.should_stop()  # before any run
            run_loop(sess)
    assert sess.step == 4 and sess.restored_step == 4
    assert complete_steps(tmp_path) == [0, 4] and jm.latest_checkpoint_step(tmp_path) == 4
    lines = [r.getMessage() for r in caplog.records if "stopped early at step 4" in r.getMessage()]
    assert len(lines) == 1 and "patience > 2" in lines[0] and "new checkpoint_dir" in lines[0]
    assert [r.levelno for r in caplog.records if r.getMessage() == lines[0]] == [logging.INFO]


def test_a_larger_patience_trains_on_from_an_early_stop_counting_on(tmp_path, caplog):
    _, sess = early_stopped_session(tmp_path)
    with sess:
        run_loop(sess)
    with caplog.at_level(logging.INFO, logger="jaxmon"):
        stop, sess = early_stopped_session(tmp_path, patience=4)
        with sess:
            run_loop(sess)
    assert sess.step == 6 and stop.stopped_step == 6  # two more checks: four without improvement in all
    assert complete_steps(tmp_path) == [0, 4, 6]
    assert "patience=4 allows more, so training goes on" in caplog.text


# -- data without a position warns once on a resume ------------------------------------------


def batches():
    for i in range(100):
        yield {"x": np.float32(i)}


def train_twice(directory, make_data, caplog):
    """Trains to step 3 on `make_data()`, then resumes on a fresh `make_data()` to step 5;
    returns the jaxmon warnings of each session."""
    warned = []
    for last_step in (3, 5):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="jaxmon"):
            hooks = [jm.CheckpointSaverHook(directory, save_steps=100), jm.StopAtStepHook(last_step=last_step)]
            with jm.MonitoredSession(count_step, zero, data=make_data(), hooks=hooks) as sess:
                run_loop(sess)
        assert sess.step == last_step
        warned.append(warnings_of(caplog))
    return warned


def test_a_resume_on_a_generator_warns_once_naming_it_and_the_fix(tmp_path, caplog):
    fresh, resumed = train_twice(tmp_path, batches, caplog)
    assert fresh == []  # nothing to resume: nothing to say
    assert len(resumed) == 1
    assert "Resumed from checkpoint 3" in resumed[0] and "(a generator) has no get_state()" in resumed[0]
    assert "jm.ArrayDataSource" in resumed[0] and "jm.ResumableIterator" in resumed[0]


def test_a_resume_on_a_list_warns_too_and_on_data_with_a_position_not(tmp_path, caplog):
    _, resumed = train_twice(tmp_path / "list", lambda: [{"x": np.float32(i)} for i in range(10)], caplog)
    assert len(resumed) == 1 and "(a list) has no get_state()" in resumed[0]
    assert train_twice(tmp_path / "counter", Counter, caplog) == [[], []]
    assert jm.restore_checkpoint(tmp_path / "counter").meta["data"] == {"i": 5}


# -- jaxmon plot: log axes where a metric spans decades, eval told from train -----------------


def decaying_step(state, batch):
    state = state + 1
    loss = 10.0 ** (-state / 4.0)  # five decades over 20 steps
    return state, {"loss": loss, "accuracy": 1.0 - loss / 2}


def eval_loss(state, batch):
    return {"loss": 2 * 10.0 ** (-state / 4.0)}


@pytest.fixture(scope="module")
def plotted_run(tmp_path_factory):
    """A real run's metrics.jsonl: loss and accuracy every step, eval/loss every 5 steps."""
    workdir = tmp_path_factory.mktemp("plotted")
    hooks = [jm.EvalHook(eval_loss, [{}], every_n_steps=5, output_dir=workdir), jm.StopAtStepHook(last_step=20)]
    with jm.MonitoredTrainingSession(decaying_step, zero, checkpoint_dir=workdir, hooks=hooks, save_summaries_steps=1,
                                     log_step_count_steps=0) as sess:
        run_loop(sess)
    return workdir


def test_plot_draws_a_loss_spanning_decades_on_a_log_axis_and_eval_in_its_own_colour(plotted_run, tmp_path):
    series = _cli.read_series(str(plotted_run / "metrics.jsonl"))
    assert series["eval/loss"][0] == [5, 10, 15, 20] and len(series["loss"][0]) == 20
    assert {tag for tag in series if tag.startswith("perf/")} == {  # the session's throughput (no batch: no
        "perf/steps_per_sec", "perf/tflops_per_sec_per_device"}       # examples), a panel each
    series = {tag: values for tag, values in series.items() if not tag.startswith("perf/")}
    panels = _cli.plot_plan({"run": series})
    assert [(p.title, p.yscale) for p in panels] == [("accuracy", "linear"), ("loss", "log")]
    figure = _cli.draw(panels, "run")
    loss = next(ax for ax in figure.axes if ax.get_title() == "loss")
    assert loss.get_yscale() == "log"
    train, evaluated = loss.get_lines()
    assert (train.get_label(), evaluated.get_label()) == ("loss", "eval/loss")
    assert to_hex(train.get_color()) != to_hex(evaluated.get_color())
    assert (evaluated.get_marker(), evaluated.get_linestyle()) == ("o", "--") and train.get_linestyle() == "-"
    assert [t.get_text() for t in loss.get_legend().get_texts()] == ["loss", "eval/loss"]
    plt.close(figure)

    out = tmp_path / "curves.png"
    assert _cli.main(["plot", str(plotted_run), "--out", str(out), "--tags", "loss", "eval/loss", "accuracy"]) == 0
    assert matplotlib.image.imread(out).shape[:2] == (320, 900)  # two panels of one row, at 100 dpi


def test_plot_keeps_one_colour_per_run_with_several_runs(plotted_run):
    series = _cli.read_series(str(plotted_run / "metrics.jsonl"))
    loss = {p.title: p for p in _cli.plot_plan({"a": series, "b": series})}["loss"]
    assert [(line.label, line.color, line.eval) for line in loss.lines] == [
        ("a: loss", "C0", False), ("a: eval/loss", "C0", True), ("b: loss", "C1", False), ("b: eval/loss", "C1", True)]


# -- jaxmon inspect marks the kept-best checkpoints ------------------------------------------


def test_inspect_ranks_checkpoints_by_the_metric_orbax_keeps_with_them(tmp_path, capsys):
    import orbax.checkpoint as ocp

    # Orbax's own layout of a kept metric: STEP/metrics/metrics, as CheckpointManager writes it.
    options = ocp.CheckpointManagerOptions(best_fn=lambda metrics: metrics["best"], best_mode="max")
    with ocp.CheckpointManager(tmp_path, options=options, item_handlers={"state": ocp.PyTreeCheckpointHandler()}) as m:
        for step, accuracy in [(1, 0.5), (2, 0.9), (3, 0.7)]:
            m.save(step, args=ocp.args.Composite(state=ocp.args.PyTreeSave({"w": np.ones(2)})),
                   metrics={"best": accuracy, "mode": "max"})
    info = _cli.run_info(str(tmp_path))
    assert [(c["step"], c["best_metric"], c["best_rank"]) for c in info["checkpoints"]] == [
        (1, 0.5, 3), (2, 0.9, 1), (3, 0.7, 2)]
    assert _cli.main(["inspect", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[2].startswith("  step        1") and lines[2].endswith("best_metric 0.5  (#3)")
    assert lines[3].endswith("best_metric 0.9  (best)") and lines[4].endswith("best_metric 0.7  (#2)")


def test_inspect_of_a_run_that_keeps_the_best_marks_it_and_a_resume_keeps_them(tmp_path, capsys):
    losses = jnp.asarray([9.0, 5.0, 1.0, 4.0, 6.0, 2.0, 7.0, 8.0, 9.0, 9.5, 9.7], jnp.float32)

    def step_fn(state, batch):
        state = state + 1
        return state, {"loss": losses[state]}

    def train(last_step):
        saver = jm.CheckpointSaverHook(tmp_path, save_steps=1, max_to_keep=2, keep_best=2, best_metric="loss")
        with jm.MonitoredSession(step_fn, zero, hooks=[saver, jm.StopAtStepHook(last_step=last_step)]) as sess:
            run_loop(sess)

    train(8)
    assert complete_steps(tmp_path) == [2, 5, 7, 8]  # the two best (losses 1 and 2) and the two latest
    assert json.loads((tmp_path / "2" / "metrics" / "metrics").read_text()) == {"best": 1.0, "mode": "min"}
    info = _cli.run_info(str(tmp_path))
    assert [(c["step"], c["best_metric"], c["best_rank"]) for c in info["checkpoints"]] == [
        (2, 1.0, 1), (5, 2.0, 2), (7, 8.0, 3), (8, 9.0, 4)]
    assert _cli.main(["inspect", str(tmp_path), "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)["checkpoints"]
    assert [c["best_rank"] for c in shown] == [1, 2, 3, 4] and shown[0]["best_mode"] == "min"

    train(10)  # a resumed run ranks the earlier checkpoints by their metric on disk: the best two stay
    assert complete_steps(tmp_path) == [2, 5, 9, 10]
    assert [(c["step"], c["best_rank"]) for c in _cli.run_info(str(tmp_path))["checkpoints"]] == [
        (2, 1), (5, 2), (9, 3), (10, 4)]
