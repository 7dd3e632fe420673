"""A checkpoint of step N holds every hook's state after every hook's `after_run` of step
N, whatever the hook order: the save waits until every hook has seen its step."""

import jax.numpy as jnp
import numpy as np
import pytest
from helpers import RunCounter, forever, zero

import jaxmon as jm
from jaxmon._checkpoints.manager import complete_steps


def count_step(state, batch):
    n = state + 1
    return n, {"loss": 1.0 / n.astype(jnp.float32)}


def train(directory, hooks, last_step, **kwargs):
    with jm.MonitoredSession(count_step, zero, data=forever(), checkpoint_dir=directory,
                             hooks=[*hooks, jm.StopAtStepHook(last_step=last_step)], **kwargs) as sess:
        while not sess.should_stop():
            sess.run()
    return sess


@pytest.mark.parametrize("k", [1, 4])
def test_a_hook_after_the_saver_restores_the_count_of_the_checkpoints_own_step(tmp_path, k):
    saver, counter = jm.CheckpointSaverHook(tmp_path, save_steps=8), RunCounter()
    train(tmp_path, [saver, counter], last_step=20, steps_per_dispatch=k)
    assert complete_steps(tmp_path) == [0, 8, 16, 20]
    runs = {0: 0, 8: 8, 16: 16, 20: 20} if k == 1 else {0: 0, 8: 2, 16: 4, 20: 5}  # runs of 4 steps
    for step, count in runs.items():
        [(key, state)] = [(key, s) for key, s in jm.restore_checkpoint(tmp_path, step=step).meta["hooks"].items()
                          if key.startswith("RunCounter")]
        assert state == {"count": count}, (step, key)
    # A resumed run takes the count back at the step it restores, as if it had not stopped.
    resumed = RunCounter()
    sess = jm.MonitoredSession(count_step, zero, data=forever(), checkpoint_dir=tmp_path,
                               hooks=[jm.CheckpointSaverHook(tmp_path, save_steps=8), resumed])
    assert sess.step == 20 and resumed.count == runs[20]
    sess.close()


def test_keep_best_ranks_each_checkpoint_by_the_evaluation_of_its_own_step(tmp_path):
    # The evaluation loss is lowest at step 30 (|step - 30|); the EvalHook comes after the saver.
    evaluate = jm.EvalHook(lambda state, batch: {"loss": jnp.abs(state - 30).astype(jnp.float32)},
                           data=[{"x": np.zeros(1)}], every_n_steps=10)
    saver = jm.CheckpointSaverHook(tmp_path, save_steps=10, max_to_keep=1, keep_best=1,
                                   best_metric=lambda session: evaluate.latest["loss"] if evaluate.latest else np.inf)
    train(tmp_path, [saver, evaluate], last_step=60)
    # 30: the best evaluation, ranked by its own; 60: the latest.
    assert complete_steps(tmp_path) == [30, 60]
    assert [step for step, _ in evaluate.history] == [10, 20, 30, 40, 50, 60]


def test_the_evaluation_history_is_complete_after_a_resume(tmp_path):
    def hooks():
        return [jm.CheckpointSaverHook(tmp_path, save_steps=10),
                jm.EvalHook(lambda state, batch: {"value": state.astype(jnp.float32)}, data=[{"x": np.zeros(1)}],
                            every_n_steps=10)]

    train(tmp_path, hooks(), last_step=20)
    resumed = hooks()
    sess = train(tmp_path, resumed, last_step=40)
    assert sess.restored_step == 20
    assert resumed[1].history == [(10, {"value": 10.0}), (20, {"value": 20.0}), (30, {"value": 30.0}),
                                  (40, {"value": 40.0})]


def test_best_metric_may_be_none_or_infinite_before_its_first_value(tmp_path):
    values = iter([None, np.inf, 3.0, 1.0, 2.0])
    saver = jm.CheckpointSaverHook(tmp_path, save_steps=5, max_to_keep=1, keep_best=1,
                                   best_metric=lambda session: next(values))
    train(tmp_path, [saver], last_step=20)
    assert saver.saved_steps == [0, 5, 10, 15, 20]
    assert complete_steps(tmp_path) == [15, 20]  # the best (1.0 at step 15) and the latest


def test_best_metric_nan_says_what_it_must_be(tmp_path):
    saver = jm.CheckpointSaverHook(tmp_path, save_steps=5, keep_best=1, best_metric=lambda session: float("nan"))
    with pytest.raises(ValueError, match="best_metric .* is nan at step 0"):
        train(tmp_path, [saver], last_step=10)
