"""NaN and spike roll-back: `NanHook(on_nan="rollback")` goes back to the newest complete
checkpoint, moves the data past the batches from it through the bad step (named in the
log), and trains on to its last step; `max_rollbacks` bounds it; the spike rule judges
a finite loss against its running average on the device. The state sums the ids of the
batches it trained on, so the tests read back exactly which batches were used."""

import json
import logging

import jax.numpy as jnp
import numpy as np
import pytest

import jaxmon as jm
from jaxmon._checkpoints.manager import complete_steps


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def step_fn(state, batch):
    loss = jnp.mean(batch["x"]) + 0.0 * state["count"]
    return {"count": state["count"] + 1, "ids": state["ids"] + jnp.sum(batch["id"])}, {"loss": loss}


def init_fn():
    return {"count": jnp.zeros((), jnp.int32), "ids": jnp.zeros((), jnp.int32)}


def source(x):
    return jm.ArrayDataSource({"id": np.arange(len(x), dtype=np.int32), "x": np.asarray(x, np.float32)},
                              batch_size=1, shuffle=False)


def train(workdir, x, last_step, nan_hook, **kwargs):
    with jm.MonitoredTrainingSession(step_fn, init_fn, data=source(x), checkpoint_dir=str(workdir),
                                     save_checkpoint_steps=10, save_summaries_steps=None, log_step_count_steps=None,
                                     hooks=[nan_hook, jm.StopAtStepHook(last_step=last_step)], **kwargs) as sess:
        while not sess.should_stop():
            sess.run()
    return sess


def test_a_nan_at_step_37_rolls_back_to_30_skips_the_batches_of_31_to_37_and_reaches_the_last_step(
        tmp_path, caplog):
    x = np.ones(100, np.float32)
    x[36] = np.nan  # the batch of step 37
    hook = jm.NanHook(on_nan="rollback", output_dir=str(tmp_path))
    with caplog.at_level(logging.INFO, logger="jaxmon"):
        sess = train(tmp_path, x, last_step=60, nan_hook=hook)
    assert sess.step == 60 and int(sess.state["count"]) == 60
    assert int(sess.state["ids"]) == sum(range(30)) + sum(range(37, 67))  # steps 31-60 ran batches 37-66
    rolled = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Rolled back")]
    assert rolled == ["Rolled back to step 30 for the bad step 37: the batches of steps 31 to 37 are skipped "
                      '(their data positions: {"epoch": 0, "index": 30, "seed": 0}, {"epoch": 0, "index": 31, '
                      '"seed": 0}, ..., {"epoch": 0, "index": 36, "seed": 0}).'], rolled
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("NaN loss")]
    assert len(said) == 1 and "NaN loss during training: 'loss' = nan at step 37" in said[0], said
    assert "(roll-back 1 of at most 3)" in said[0]
    assert complete_steps(str(tmp_path))[-3:] == [40, 50, 60]  # the saver's schedule went back to step 30 too
    counts = [r for r in read_jsonl(tmp_path / "metrics.jsonl") if "nan/rollbacks" in r]
    assert counts[-1]["nan/rollbacks"] == 1 and counts[-1]["nan/skipped_batches"] == 7
    assert counts[-1]["nan/nan_steps"] == 1 and counts[-1]["nan/spike_steps"] == 0


def test_with_max_rollbacks_0_a_nan_raises_as_before(tmp_path):
    x = np.ones(100, np.float32)
    x[36] = np.nan
    with pytest.raises(jm.NanLossDuringTrainingError, match="NaN loss during training: 'loss' = nan at step 37. "
                       r".*, after 0 roll-back\(s\), the most max_rollbacks=0 allows") as raised:
        train(tmp_path, x, last_step=60, nan_hook=jm.NanHook(on_nan="rollback", max_rollbacks=0))
    assert raised.value.step == 37
    assert jm.latest_checkpoint_step(str(tmp_path)) == 30  # nothing after the bad step was saved


def test_a_loss_100_times_its_average_at_step_53_is_rolled_back_by_the_spike_rule(tmp_path, caplog):
    x = 1.0 + 0.01 * np.sin(np.arange(100, dtype=np.float32))
    x[52] *= 100  # the batch of step 53
    hook = jm.NanHook(on_nan="rollback", spike_factor=10.0, output_dir=str(tmp_path))
    with caplog.at_level(logging.INFO, logger="jaxmon"):
        sess = train(tmp_path, x, last_step=70, nan_hook=hook)
    assert sess.step == 70
    assert int(sess.state["ids"]) == sum(range(50)) + sum(range(53, 73))  # batches 50-52 skipped
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Spike")]
    assert len(said) == 1 and "Spike in the loss during training: 'loss' = " in said[0] and "at step 53" in said[0]
    assert any(r.getMessage().startswith("Rolled back to step 50 for the bad step 53: the batches of steps 51 to "
                                         "53 are skipped") for r in caplog.records)
    counts = [r for r in read_jsonl(tmp_path / "metrics.jsonl") if "nan/rollbacks" in r]
    assert counts[-1]["nan/spike_steps"] == 1 and counts[-1]["nan/skipped_batches"] == 3


def test_a_run_that_diverges_from_its_first_steps_is_stopped_before_an_evaluation_of_the_bad_state(tmp_path):
    """The loss grows 1000-fold at step 3, inside the spike rule's warm-up: judged against
    the first step's loss, it is caught; the evaluation due at step 5 reads the check
    first, so it never evaluates the bad state."""
    x = np.ones(100, np.float32)
    x[2:] = 1000.0  # from the batch of step 3 on
    evaluations = jm.EvalHook(lambda state, batch: {"count": state["count"]}, [{"x": np.ones(1)}], every_n_steps=5,
                              at_end=False)
    with pytest.raises(jm.NanLossDuringTrainingError, match="Spike in the loss during training: 'loss' = 1000 at "
                                                            "step 3") as raised:
        train(tmp_path, x, last_step=60, nan_hook=jm.NanHook(spike_factor=10.0, every_n_steps=100),
              chief_only_hooks=[evaluations])
    assert raised.value.step == 3 and evaluations.history == []
    assert jm.latest_checkpoint_step(str(tmp_path)) == 0  # nothing after the bad step was saved


def test_rollbacks_stop_after_max_rollbacks(tmp_path):
    x = np.ones(200, np.float32)
    x[[36, 44, 55]] = np.nan  # three bad batches: two roll-backs allowed
    with pytest.raises(jm.NanLossDuringTrainingError, match="after 2 roll-back"):
        train(tmp_path, x, last_step=100, nan_hook=jm.NanHook(on_nan="rollback", max_rollbacks=2))


def test_rollback_needs_a_checkpoint_dir_and_a_known_on_nan():
    with pytest.raises(ValueError, match="on_nan must be 'raise', 'stop' or 'rollback'; got 'skip'"):
        jm.NanHook(on_nan="skip")
    with pytest.raises(ValueError, match="no checkpoint_dir"):
        jm.MonitoredSession(step_fn, init_fn, data=source(np.ones(4)), hooks=[jm.NanHook(on_nan="rollback")])
    with pytest.raises(ValueError, match="spike_factor must be a number > 1"):
        jm.NanHook(spike_factor=0.5)


def test_a_stop_asked_for_at_a_step_the_roll_back_undid_is_asked_again_at_the_last_step(tmp_path):
    x = np.ones(100, np.float32)
    x[37] = np.nan  # step 38's batch; seen at the save of step 40, where StopAtStepHook has already asked to stop
    goodput = jm.GoodputHook(output_dir=str(tmp_path), every_n_steps=100)
    with jm.MonitoredTrainingSession(step_fn, init_fn, data=source(x), checkpoint_dir=str(tmp_path),
                                     save_checkpoint_steps=10, save_summaries_steps=None, log_step_count_steps=None,
                                     hooks=[jm.StopAtStepHook(last_step=40), goodput,
                                            jm.NanHook(on_nan="rollback", every_n_steps=20)]) as sess:
        while not sess.should_stop():
            sess.run()
    assert sess.step == 40  # not 31: the stop of the undone step 40 was forgotten, then asked again
    assert int(sess.state["ids"]) == sum(range(30)) + sum(range(38, 48))
    assert sess.time_spent.redone_steps == 10  # steps 31-40 ran twice
    assert goodput.totals()["lost"] > 0
