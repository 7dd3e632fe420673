"""Fetched values come back in TF's structure: a name or a callable gives its value, a
list a list, a dict a dict; for hooks, `run(fetches=...)` and `FinalOpsHook`. Nested
outputs are fetched by path."""

import time
from datetime import datetime

import jax.numpy as jnp
import numpy as np
import pytest
from helpers import float_zero

import jaxmon as jm
import jaxmon as tf_train  # the TF tutorial's `tf.train`, as a TF user would alias it


def step_fn(state, batch):
    state = state + 1.0
    return state, {"loss": 10.0 / state, "x": 2.0 * state}


def doubled(state, batch, outputs):
    return 2.0 * state


class Recording(jm.Hook):
    def __init__(self, fetches):
        self.fetches, self.results = fetches, []

    def before_run(self, ctx):
        return jm.RunArgs(fetches=self.fetches)

    def after_run(self, ctx, values):
        self.results.append(values.results)


@pytest.mark.parametrize("fetches, expected", [
    ("loss", 5.0),
    (doubled, 4.0),
    (["loss", "x"], [5.0, 4.0]),
    (["x", doubled, "loss"], [4.0, 4.0, 5.0]),
    ({"l": "loss", "twice": doubled}, {"l": 5.0, "twice": 4.0}),
])
def test_hooks_and_run_get_their_values_in_the_structure_they_asked(fetches, expected):
    hook = Recording(fetches)
    sess = jm.MonitoredSession(step_fn, float_zero, hooks=[hook])
    sess.run({})
    ran = sess.run({}, fetches=fetches)
    sess.close()
    for got in (hook.results[1], ran):
        assert type(got) is (np.ndarray if isinstance(expected, float) else type(expected))
        if isinstance(expected, dict):
            assert {k: float(v) for k, v in got.items()} == expected
        elif isinstance(expected, list):
            assert [float(v) for v in got] == expected
        else:
            assert isinstance(got, np.ndarray) and float(got) == expected


def test_a_list_unpacks_as_in_tf():
    hook = Recording(["loss", "x"])
    with jm.MonitoredSession(step_fn, float_zero, hooks=[hook]) as sess:
        loss, x = sess.run({}, fetches=["loss", "x"])
    assert (float(loss), float(x)) == (10.0, 2.0)
    loss_value, acc = hook.results[0]
    assert (float(loss_value), float(acc)) == (10.0, 2.0)


def test_final_ops_values_keep_the_structure_of_their_fetches():
    hooks = [jm.FinalOpsHook("loss"), jm.FinalOpsHook(["loss", doubled]), jm.FinalOpsHook({"x": "x"})]
    with jm.MonitoredSession(step_fn, float_zero, hooks=hooks, data=[{}] * 3):
        pass
    sess = jm.MonitoredSession(step_fn, float_zero, hooks=hooks, data=[{}] * 3)
    with sess:
        while not sess.should_stop():
            sess.run()
    assert float(hooks[0].final_values) == pytest.approx(10.0 / 3)
    assert [float(v) for v in hooks[1].final_values] == [pytest.approx(10.0 / 3), 6.0]
    assert {k: float(v) for k, v in hooks[2].final_values.items()} == {"x": 6.0}


def test_the_cifar10_tutorials_logger_hook_runs_unchanged(capsys):
    # From TF 1.x's tutorials/image/cifar10/cifar10_train.py, apart from the imports.
    class FLAGS:
        log_frequency = 10
        batch_size = 128

    loss = "loss"

    class _LoggerHook(tf_train.SessionRunHook):
        """Logs loss and runtime."""

        def begin(self):
            self._step = -1
            self._start_time = time.time()

        def before_run(self, run_context):
            self._step += 1
            return tf_train.SessionRunArgs(loss)  # Asks for loss value.

        def after_run(self, run_context, run_values):
            if self._step % FLAGS.log_frequency == 0:
                current_time = time.time()
                duration = current_time - self._start_time
                self._start_time = current_time

                loss_value = run_values.results
                examples_per_sec = FLAGS.log_frequency * FLAGS.batch_size / duration
                sec_per_batch = float(duration / FLAGS.log_frequency)

                format_str = ('%s: step %d, loss = %.2f (%.1f examples/sec; %.3f '
                              'sec/batch)')
                print(format_str % (datetime.now(), self._step, loss_value, examples_per_sec, sec_per_batch))

    with jm.MonitoredTrainingSession(step_fn, float_zero, data=[{}] * 25, hooks=[_LoggerHook()],
                                     save_summaries_steps=None, log_step_count_steps=None) as mon_sess:
        while not mon_sess.should_stop():
            mon_sess.run()
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(": ", 1)[1].split(" (")[0] for line in lines] == [
        "step 0, loss = 10.00", "step 10, loss = 0.91", "step 20, loss = 0.48"]


def nested_step(state, batch):
    state = state + 1.0
    grads = {"dense1": {"w": jnp.full((4,), state), "b": state}, "dense2": {"w": jnp.arange(3.0) * state}}
    return state, {"loss": 1.0 / state, "grads": grads}


def test_a_nested_output_is_fetched_by_its_path_or_as_a_sub_dict():
    with jm.MonitoredSession(nested_step, float_zero) as sess:
        w, grads = sess.run({}, fetches=["grads/dense2/w", "grads"])
    assert w.tolist() == [0.0, 1.0, 2.0]
    assert grads["dense1"]["w"].tolist() == [1.0] * 4 and float(grads["dense1"]["b"]) == 1.0
    listed = r"'grads/dense3', which is not an output .* \['grads/dense1/b', 'grads/dense1/w'"
    with pytest.raises(ValueError, match=listed):
        jm.MonitoredSession(nested_step, float_zero).run({}, fetches="grads/dense3")


@pytest.mark.parametrize("reduce", ["last", "mean"])
def test_a_nested_output_is_summarised_by_path_as_histograms_and_in_metrics_jsonl(tmp_path, reduce):
    import json

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    hook = jm.SummarySaverHook(save_steps=2, output_dir=tmp_path, summaries={"grads": jm.Histogram("grads")},
                               reduce=reduce)
    with jm.MonitoredSession(nested_step, float_zero, hooks=[hook], data=[{}] * 4) as sess:
        while not sess.should_stop():
            sess.run()
    events = EventAccumulator(str(tmp_path), size_guidance={"histograms": 0, "scalars": 0})
    events.Reload()
    assert sorted(events.Tags()["histograms"]) == ["grads/dense1/b", "grads/dense1/w", "grads/dense2/w"]
    dense2 = events.Histograms("grads/dense2/w")
    assert [h.step for h in dense2] == [1, 2, 4]  # step 1, then every 2 steps
    assert (dense2[-1].histogram_value.min, dense2[-1].histogram_value.max) == (0.0, 8.0)  # arange(3) * 4
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    written = {record["step"]: record for record in records}
    # Every scalar output, a nested one by its path (the value t at step t): at step 2 its
    # value (last) or mean over steps 1 and 2 (the starting point's write at step 1 ends no
    # window), at step 4 its value or mean over steps 3 and 4.
    assert written[1]["grads/dense1/b"] == 1.0
    assert written[2]["grads/dense1/b"] == (2.0 if reduce == "last" else 1.5)  # (1 + 2) / 2
    assert written[4]["grads/dense1/b"] == (4.0 if reduce == "last" else 3.5)
    assert written[4]["loss"] == pytest.approx(1 / 4 if reduce == "last" else (1 / 3 + 1 / 4) / 2)
    assert [event.step for event in events.Scalars("grads/dense1/b")] == [1, 2, 4]
