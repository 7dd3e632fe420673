"""`debug_host_syncs=True`: a hook called on every run, or a data iterator, that reads a
device value on the host raises `HostSyncError` naming it (on the CPU backend too, where
JAX's own transfer guard lets such reads through); a hook reading at its trigger, and
the default set of hooks, run clean. A batch that reaches its dispatch on the host, and
any implicit copy to the device in a dispatch, raise too."""

import os
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest
from helpers import DEFAULT, ROOT

import jaxmon as jm


def step_fn(state, batch):
    state = state + jnp.mean(batch["x"])
    return state, {"loss": state * 2.0}


def source():
    return jm.ArrayDataSource({"x": np.arange(64, dtype=np.float32).reshape(32, 2)}, batch_size=2, shuffle=False)


class ReadsEveryRun(jm.Hook):
    """Reads the loss on the host after every run: a host sync per step."""

    def __init__(self, on_error="raise"):
        self.on_error, self.losses = on_error, []

    def after_run(self, run_context, run_values):
        self.losses.append(float(run_values.outputs["loss"]))

    def __repr__(self):
        return "ReadsEveryRun()"


class ReadsAtItsTrigger(ReadsEveryRun):
    """The same read, every 4 steps, at its trigger."""

    def __init__(self):
        super().__init__()
        self.timer = jm.SecondOrStepTimer(every_steps=4)

    def next_trigger(self, step):
        return self.timer.next_trigger(step)

    def after_run(self, run_context, run_values):
        if self.timer.should_trigger_for_step(run_values.step):
            self.timer.update_last_triggered_step(run_values.step)
            super().after_run(run_context, run_values)


def run(hooks, data=None, steps=8, **kwargs):
    with jm.MonitoredSession(step_fn, state=jnp.zeros(()), data=data or source(),
                             hooks=[*hooks, jm.StopAtStepHook(last_step=steps)], **kwargs) as sess:
        while not sess.should_stop():
            sess.run()
    return sess


@pytest.mark.parametrize("on_error", ["raise", "warn"])
def test_a_hook_that_reads_a_device_value_every_run_raises_naming_the_hook(on_error):
    with pytest.raises(jm.HostSyncError, match=r"debug_host_syncs: a device value was read on the host \(__float__ "
                       r"of a scalar float32 array\) in ReadsEveryRun\(\), a hook called on every run \(it has no "
                       r"next_trigger\)") as raised:
        run([ReadsEveryRun(on_error)], debug_host_syncs=True)
    assert "(raised in ReadsEveryRun().after_run at step 1)" in raised.value.__notes__


def test_without_debug_host_syncs_the_same_hook_reads_as_it_likes():
    hook = ReadsEveryRun()
    run([hook])
    assert hook.losses == pytest.approx([2 * sum(4 * i + 1.5 for i in range(n)) for n in range(1, 9)])


def test_a_hook_reading_at_its_trigger_is_allowed():
    hook = ReadsAtItsTrigger()
    run([hook], debug_host_syncs=True)
    assert len(hook.losses) == 2  # after steps 4 and 8


def test_a_data_iterator_that_reads_a_device_value_raises_naming_it():
    def data():
        previous = jnp.ones((2,))
        while True:
            previous = previous + 1
            yield {"x": np.array(previous.tolist(), np.float32)}  # a host read of a device value per batch

    with pytest.raises(jm.HostSyncError, match=r"\(tolist of a 2 float32 array\) in the data iterator"):
        run([], data=data(), debug_host_syncs=True, prefetch=0)


def test_the_default_set_of_jaxmon_train_runs_clean_under_debug_host_syncs(tmp_path):
    """`jaxmon train --debug_host_syncs`: the default config's hooks (progress bar, evaluation,
    NaN check, summaries, step counter, checkpoints) read nothing between their triggers."""
    result = subprocess.run(
        [sys.executable, "-m", "jaxmon", "train", "--config", DEFAULT, "--workdir", str(tmp_path / "run"),
         "--debug_host_syncs", "--config.steps=60", "--config.hooks.1.every_n_steps=20",
         "--config.session.save_summaries_steps=10", "--config.session.log_step_count_steps=10",
         "--config.session.save_checkpoint_steps=30"],
        cwd=ROOT, text=True, capture_output=True, timeout=240, env={**os.environ, "CI": "true"})
    assert result.returncode == 0, result.stderr[-3000:]
    assert "step 60: test accuracy" in result.stdout
    assert jm.latest_checkpoint_step(str(tmp_path / "run")) == 60


# -- copies to the device at a dispatch ---------------------------------------------------------------


def test_a_batch_that_reaches_its_dispatch_on_the_host_is_named_with_the_fix():
    with jm.MonitoredSession(step_fn, state=jnp.zeros(()), debug_host_syncs=True) as sess:
        sess.run({"x": jnp.ones(2)})  # on the device already: nothing to copy
        with pytest.raises(jm.HostSyncError, match=r"the batch of step 2 reached its dispatch on the host "
                           r"\(batch\['x'\], a 2 float64 value\).*jax.device_put"):
            sess.run({"x": np.ones(2)})
    with pytest.raises(jm.HostSyncError, match=r"the batch of step 1 reached its dispatch on the host.*prefetch >= 1"):
        run([], debug_host_syncs=True, prefetch=0)
    assert run([], debug_host_syncs=True).step == 8  # data= sends each run's batch ahead


def test_an_implicit_copy_in_a_dispatch_raises_naming_the_step(monkeypatch):
    """A host value handed to the compiled step without being sent (here: batches left on
    the host as a regression would) is JAX's implicit copy, refused at the dispatch."""
    from jaxmon._run.dispatch import Dispatch

    monkeypatch.setattr(Dispatch, "_put", lambda self, batch, steps: batch)
    with pytest.raises(jm.HostSyncError, match=r"a host value \(ShapedArray\(float32\[2,2\]\)\) was copied to the "
                       r"device implicitly in the dispatch of step 1"):
        run([], debug_host_syncs=True)
    assert run([]).step == 8  # without debug_host_syncs, JAX copies it
