"""What users met on their first runs, each read back from real artefacts: an early-stopped
run resumed, data without a position resumed, `jaxmon plot`'s axes and `jaxmon inspect`'s
kept-best checkpoints."""

from __future__ import annotations

import logging

import jax.numpy as jnp
from helpers import zero

import jaxmon as jm
from jaxmon._checkpoint import complete_steps

# The loss after each step: it improves up to step 2 and never again.
LOSSES = jnp.asarray([9.0, 5.0, 3.0, 3.0, 3.0, 3.0, 3.0, 3.0, 3.0, 3.0, 3.0, 3.0], jnp.float32)


def plateau_step(state, batch):
    state = state + 1
    return state, {"loss": LOSSES[state]}


def run_loop(sess):
    while not sess.should_stop():
        sess.run()


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
