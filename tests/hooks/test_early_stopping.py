"""EarlyStoppingHook: a stop after `patience` checks without improvement, on an EvalHook's
metric or a training output."""

import jax.numpy as jnp
import numpy as np
import pytest
from helpers import EQUAL_BATCHES, count_step, float_count, float_zero, run_loop, scaled_eval, zero

import jaxmon as jm


def table_eval(values):
    """An eval_fn whose "loss" (and "acc") at step s is values[s]; the state is an int counter."""
    table = jnp.asarray(values, jnp.float32)

    def eval_fn(state, batch):
        return {"loss": table[state], "acc": table[state]}

    return eval_fn


ONE_BATCH = [{"x": np.ones((2,), np.float32)}]


def early_session(eval_values, last_step=20, **stop_kwargs):
    source = jm.EvalHook(table_eval(eval_values), ONE_BATCH, every_n_steps=1)
    stop = jm.EarlyStoppingHook(stop_kwargs.pop("fetch", "loss"), source=source, **stop_kwargs)
    sess = jm.MonitoredSession(count_step, zero, hooks=[source, stop, jm.StopAtStepHook(last_step=last_step)])
    return source, stop, sess


def test_early_stopping_on_eval_loss_stops_after_patience_checks_without_improvement():
    #            step: 0   1    2    3    4    5    6    7    8    ...
    values = [9.0, 5.0, 3.0, 2.0, 2.5, 2.0, 1.0, 0.5, 0.1] + [0.0] * 20
    source, stop, sess = early_session(values, patience=2)
    with sess:
        run_loop(sess)
        assert sess.should_stop()
    assert sess.step == 5 and stop.stopped_step == 5
    assert stop.best == 2.0 and stop.best_step == 3
    assert [step for step, _ in source.history] == [1, 2, 3, 4, 5]  # no extra eval at the end


def test_early_stopping_mode_max():
    values = [0.0, 0.5, 0.7, 0.8, 0.75, 0.8, 0.9] + [1.0] * 20
    _, stop, sess = early_session(values, fetch="acc", mode="max", patience=2)
    with sess:
        run_loop(sess)
    assert sess.step == 5 and stop.stopped_step == 5 and stop.best == pytest.approx(0.8) and stop.best_step == 3


def test_early_stopping_improvements_smaller_than_min_delta_do_not_count():
    values = [9.0, 5.0, 4.95, 4.92, 4.0] + [0.0] * 20
    _, stop, sess = early_session(values, patience=2, min_delta=0.1)
    with sess:
        run_loop(sess)
    assert sess.step == 3 and stop.stopped_step == 3 and stop.best == 5.0 and stop.best_step == 1

    _, stop, sess = early_session(values, last_step=4, patience=2, min_delta=0.0)
    with sess:
        run_loop(sess)
    assert stop.stopped_step is None and stop.best == 4.0 and stop.best_step == 4


def test_early_stopping_on_a_train_output_every_2_steps():
    #        step: 0    1    2    3    4    5    6    7    8
    table = jnp.asarray([9.0, 0.0, 5.0, 0.0, 3.0, 0.0, 4.0, 0.0, 3.5] + [0.0] * 20, jnp.float32)

    def step_fn(state, batch):
        state = state + 1
        return state, {"loss": table[state]}

    stop = jm.EarlyStoppingHook("loss", patience=2, every_n_steps=2)
    with jm.MonitoredSession(step_fn, zero, hooks=[stop, jm.StopAtStepHook(last_step=20)]) as sess:
        run_loop(sess)
    # Checked after steps 2, 4, 6, 8: 5, 3 (best), 4, 3.5 -> two checks without improvement.
    assert sess.step == 8 and stop.stopped_step == 8
    assert stop.best == 3.0 and stop.best_step == 4
    assert sess.compile_count == 1


@pytest.mark.parametrize("kwargs, error", [
    ({"mode": "avg"}, ValueError),
    ({"patience": -1}, ValueError),
    ({"source": object()}, TypeError),
    ({"source": "eval"}, TypeError),
])
def test_early_stopping_validates_its_arguments(kwargs, error):
    with pytest.raises(error):
        jm.EarlyStoppingHook("loss", **kwargs)


def test_early_stopping_with_a_source_takes_no_period_of_its_own():
    source = jm.EvalHook(scaled_eval, EQUAL_BATCHES, every_n_steps=5)
    with pytest.raises(ValueError, match="every_n_steps"):
        jm.EarlyStoppingHook("loss", source=source, every_n_steps=5)
    with pytest.raises(ValueError):
        jm.EarlyStoppingHook("loss", source=source, every_n_secs=5.0)


def test_early_stopping_on_a_metric_the_source_does_not_report():
    source = jm.EvalHook(scaled_eval, EQUAL_BATCHES, every_n_steps=1)
    stop = jm.EarlyStoppingHook("val_loss", source=source)
    sess = jm.MonitoredSession(float_count, float_zero, hooks=[source, stop])
    with pytest.raises(ValueError, match="val_loss") as info:
        sess.run()
    assert "['acc', 'loss']" in str(info.value)
