"""CheckpointSaverHook and its listeners on real Orbax checkpoints: when it saves, what it
keeps, what each checkpoint holds, and how save failures are handled (one writer per
directory: tests/checkpoints/test_manager.py).

jaxmon's mapping of TF's save points: the step is a host int owned by the session; the
hook saves at session creation (step 0), then every N steps or seconds, then at `end`
if the last step was not saved. Every test reads the checkpoints back from disk.
"""

from __future__ import annotations

import math
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import FakeClock, count_step, float_zero, zero

import jaxmon as jm
from jaxmon._checkpoints.manager import complete_steps

# -- shared pieces -------------------------------------------------------------------------


def restore(directory, step, like=None):
    return jm.restore_checkpoint(os.fspath(directory), step=step, like=zero() if like is None else like)


def train(hooks, last_step, step_fn=count_step, init_fn=zero, **kwargs):
    """Runs a session until `last_step` (a StopAtStepHook is added last) and closes it."""
    with jm.MonitoredSession(step_fn, init_fn, hooks=[*hooks, jm.StopAtStepHook(last_step=last_step)],
                             **kwargs) as sess:
        while not sess.should_stop():
            sess.run()
    return sess


class CountingListener(jm.CheckpointSaverListener):
    """Counts every event and records the steps of before_save/after_save/end."""

    def __init__(self, stop_after_save_at=None):
        self.counts = {"begin": 0, "before_save": 0, "after_save": 0, "end": 0}
        self.steps = {"before_save": [], "after_save": [], "end": []}
        self.stop_after_save_at = stop_after_save_at

    def begin(self):
        self.counts["begin"] += 1

    def before_save(self, session, step):
        self.counts["before_save"] += 1
        self.steps["before_save"].append(step)

    def after_save(self, session, step):
        self.counts["after_save"] += 1
        self.steps["after_save"].append(step)
        return self.stop_after_save_at is not None and step >= self.stop_after_save_at

    def end(self, session, step):
        self.counts["end"] += 1
        self.steps["end"].append(step)


class CopyingListener(jm.CheckpointSaverListener):
    """Keeps a host copy (taken in before_save) of the state each save is given."""

    def __init__(self):
        self.copies = {}

    def before_save(self, session, step):
        assert step == session.step
        self.copies[step] = jax.tree.map(lambda x: np.array(x, copy=True), session.state)


# -- arguments ----------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs", [{}, {"save_steps": 2, "save_secs": 2.0}], ids=["neither", "both"])
def test_exactly_one_of_save_secs_and_save_steps(kwargs, tmp_path):
    with pytest.raises(ValueError, match="save_steps") as info:
        jm.CheckpointSaverHook(tmp_path / "ckpt", **kwargs)
    assert "save_secs" in str(info.value)
    assert not (tmp_path / "ckpt").exists()  # nothing was created for a hook that was refused


# -- saves by steps -----------------------------------------------------------------------


def test_save_steps_saves_at_creation_then_every_n_steps(tmp_path):
    directory = tmp_path / "ckpt"
    hook = jm.CheckpointSaverHook(directory, save_steps=2, max_to_keep=None)
    latest = []
    with jm.MonitoredSession(count_step, zero, hooks=[hook]) as sess:
        assert hook.saved_steps == [0]  # the save at session creation
        hook.wait()
        latest.append(complete_steps(directory)[-1])
        for _ in range(5):
            sess.run()
            hook.wait()
            latest.append(complete_steps(directory)[-1])
        assert sess.step == 5
    # 0 at creation, still 0 after step 1, 2 after step 2, ...
    assert latest == [0, 0, 2, 2, 4, 4]
    assert hook.saved_steps == [0, 2, 4, 5]  # and 5 at end: the last step was not saved
    assert complete_steps(directory) == hook.saved_steps
    for step in hook.saved_steps:  # the checkpoint of step k holds the state after k steps
        restored = restore(directory, step)
        assert restored.step == step and restored.meta["step"] == step
        assert int(restored.state) == step
        assert np.asarray(restored.state).dtype == np.int32
    assert jm.latest_checkpoint_step(directory) == 5
    assert int(jm.restore_checkpoint(directory, like=zero()).state) == 5  # default: the latest


# -- saves by seconds, with a fake clock -----------------------------------------------------


def test_save_secs_saves_only_when_the_clock_advanced(tmp_path):
    clock = FakeClock(1000.0)
    listener = CountingListener()
    directory = tmp_path / "ckpt"
    hook = jm.CheckpointSaverHook(directory, save_secs=2, listeners=[listener], clock=clock, max_to_keep=None)
    with jm.MonitoredSession(count_step, zero, hooks=[hook]) as sess:
        for offset in (0.5, 0.5, 3.0, 3.5, 4.0, 6.5, 7.0):
            clock.t = 1000.0 + offset
            sess.run()
        clock.t = 1007.5
    # creation (0), t0+3.0 (step 3), t0+6.5 (step 6), end (step 7)
    assert hook.saved_steps == [0, 3, 6, 7]
    assert listener.counts == {"begin": 1, "before_save": 4, "after_save": 4, "end": 1}
    assert listener.steps["before_save"] == listener.steps["after_save"] == [0, 3, 6, 7]
    assert complete_steps(directory) == [0, 3, 6, 7]
    assert [int(restore(directory, s).state) for s in (0, 3, 6, 7)] == [0, 3, 6, 7]


def test_end_saves_the_last_step_when_it_was_not_saved(tmp_path):
    clock = FakeClock(1000.0)
    listener = CountingListener()
    directory = tmp_path / "ckpt"
    hook = jm.CheckpointSaverHook(directory, save_secs=2, listeners=[listener], clock=clock)
    with jm.MonitoredSession(count_step, zero, hooks=[hook]) as sess:
        for _ in range(2):  # two steps within 2 s
            clock.t += 0.5
            sess.run()
        hook.wait()
        assert complete_steps(directory) == [0]
    assert hook.saved_steps == [0, 2]
    assert listener.counts == {"begin": 1, "before_save": 2, "after_save": 2, "end": 1}
    assert listener.steps["end"] == [2]
    assert complete_steps(directory) == [0, 2]
    assert jm.latest_checkpoint_step(directory) == 2 and int(restore(directory, 2).state) == 2


# -- listeners ----------------------------------------------------------------------------


def test_listeners_see_every_save_and_end_does_not_save_twice(tmp_path):
    listeners = [CountingListener(), CountingListener()]
    directory = tmp_path / "ckpt"
    hook = jm.CheckpointSaverHook(directory, save_steps=1, listeners=listeners)
    sess = train([hook], last_step=2)
    assert sess.step == 2
    for listener in listeners:
        assert listener.counts == {"begin": 1, "before_save": 3, "after_save": 3, "end": 1}
        assert listener.steps == {"before_save": [0, 1, 2], "after_save": [0, 1, 2], "end": [2]}
    assert hook.saved_steps == [0, 1, 2]  # no duplicate save of step 2 at end
    assert complete_steps(directory) == [0, 1, 2]
    # a fresh runner restores step 2
    again = jm.MonitoredSession(count_step, zero, checkpoint_dir=directory)
    assert again.step == 2 and int(again.state) == 2
    again.close()


def test_a_listener_returning_true_from_after_save_stops_training(tmp_path):
    listener = CountingListener(stop_after_save_at=4)
    directory = tmp_path / "ckpt"
    hook = jm.CheckpointSaverHook(directory, save_steps=2, listeners=[listener])
    stops = []
    with jm.MonitoredSession(count_step, zero, hooks=[hook]) as sess:
        assert not sess.should_stop()
        while not sess.should_stop():
            sess.run()
            stops.append(sess.should_stop())
            assert len(stops) <= 10
    assert stops == [False, False, False, True]  # True after the step whose save got True
    assert sess.step == 4 and hook.saved_steps == [0, 2, 4]
    assert complete_steps(directory) == [0, 2, 4] and int(restore(directory, 4).state) == 4


def test_listener_order_around_each_save(tmp_path):
    log = []

    class Ordered(jm.CheckpointSaverListener):
        def __init__(self, name):
            self.name = name

        def before_save(self, session, step):
            log.append((self.name, "before", step))

        def after_save(self, session, step):
            log.append((self.name, "after", step))

    train([jm.CheckpointSaverHook(tmp_path / "ckpt", save_steps=5, listeners=[Ordered("a"), Ordered("b")])],
          last_step=1)
    assert log == [("a", "before", 0), ("b", "before", 0), ("a", "after", 0), ("b", "after", 0),
                   ("a", "before", 1), ("b", "before", 1), ("a", "after", 1), ("b", "after", 1)]


# -- what is kept -------------------------------------------------------------------------


def test_max_to_keep_leaves_only_the_latest_checkpoints(tmp_path):
    directory = tmp_path / "ckpt"
    hook = jm.CheckpointSaverHook(directory, save_steps=1, max_to_keep=2)
    train([hook], last_step=6)
    assert hook.saved_steps == [0, 1, 2, 3, 4, 5, 6]
    assert complete_steps(directory) == [5, 6]
    assert [int(restore(directory, s).state) for s in (5, 6)] == [5, 6]


def test_keep_period_also_keeps_the_multiples(tmp_path):
    directory = tmp_path / "ckpt"
    hook = jm.CheckpointSaverHook(directory, save_steps=1, max_to_keep=1, keep_period=3)
    train([hook], last_step=7)
    assert hook.saved_steps == list(range(8))
    kept = complete_steps(directory)
    assert kept == [s for s in hook.saved_steps if s % 3 == 0] + [7] == [0, 3, 6, 7]
    assert [int(restore(directory, s).state) for s in kept] == kept


METRIC = [0.0, 5.0, 1.0, 4.0, 2.0, 3.0, 9.0]  # by step; step 6 (the last) is the worst for "min"


def metric_step(sign):
    table = jnp.asarray(METRIC, jnp.float32) * sign

    def step_fn(state, batch):
        state = state + 1
        return state, {"metric": table[state]}

    return step_fn


@pytest.mark.parametrize("mode, sign", [("min", 1.0), ("max", -1.0)])
def test_keep_best_keeps_the_best_and_always_the_latest(mode, sign, tmp_path):
    directory = tmp_path / "ckpt"
    hook = jm.CheckpointSaverHook(directory, save_steps=1, max_to_keep=1, keep_best=2, best_metric="metric",
                                  best_mode=mode)
    train([hook], last_step=6, step_fn=metric_step(sign))
    assert hook.saved_steps == list(range(7))
    values = {step: METRIC[step] * sign for step in range(1, 7)}  # step 0 has no metric (no run yet)
    best = sorted(values, key=values.get, reverse=mode == "max")[:2]
    latest = 6
    worst = max(values, key=values.get) if mode == "min" else min(values, key=values.get)
    assert worst == latest  # the latest checkpoint has the worst metric ...
    assert complete_steps(directory) == sorted({*best, latest}) == [2, 4, 6]  # ... and is kept all the same
    assert [int(restore(directory, s).state) for s in (2, 4, 6)] == [2, 4, 6]


def test_keep_best_with_a_metric_function(tmp_path):
    directory = tmp_path / "ckpt"
    hook = jm.CheckpointSaverHook(directory, save_steps=1, max_to_keep=1, keep_best=1,
                                  best_metric=lambda session: abs(session.step - 3), best_mode="min")
    train([hook], last_step=5)
    assert complete_steps(directory) == [3, 5]


def test_a_non_finite_best_metric_is_an_error(tmp_path):
    def step_fn(state, batch):
        state = state + 1
        return state, {"metric": jnp.where(state == 2, jnp.nan, 1.0)}

    hook = jm.CheckpointSaverHook(tmp_path / "ckpt", save_steps=1, keep_best=1, best_metric="metric")
    with pytest.raises(ValueError, match="best_metric"):
        train([hook], last_step=4, step_fn=step_fn)
    assert complete_steps(tmp_path / "ckpt") == [0, 1]


# -- async and blocking saves, donation ---------------------------------------------------

SIZE = 1 << 15


def wide_init():
    return {"w": jnp.arange(SIZE, dtype=jnp.float32) / SIZE, "n": jnp.zeros((), jnp.int32)}


def wide_step(state, batch):
    w = state["w"] * 1.0001 + jnp.sin(state["w"])  # every step changes every bit pattern
    return {"w": w, "n": state["n"] + 1}, {"loss": w.sum()}


@pytest.mark.parametrize("save_steps", [1, 3])
@pytest.mark.parametrize("async_save", [True, False], ids=["async", "blocking"])
def test_every_save_holds_exactly_the_state_of_its_step(async_save, save_steps, tmp_path):
    directory = tmp_path / "ckpt"
    copies = CopyingListener()
    hook = jm.CheckpointSaverHook(directory, save_steps=save_steps, listeners=[copies], max_to_keep=None,
                                  async_save=async_save)
    assert hook.async_save is async_save
    donated = {}
    with jm.MonitoredSession(wide_step, wide_init, hooks=[hook, jm.StopAtStepHook(last_step=12)]) as sess:
        while not sess.should_stop():
            before, step = sess.state, sess.step
            sess.run()  # donates `before`, while the save of an earlier step may be in flight
            donated[step] = before["w"].is_deleted() and before["n"].is_deleted()
    expected = list(range(0, 13, save_steps)) + ([] if 12 % save_steps == 0 else [12])
    assert hook.saved_steps == expected and sorted(copies.copies) == expected
    # donation is on: every state that was not just saved went into the next step donated
    assert all(donated[step] for step in range(12) if step not in expected)
    assert complete_steps(directory) == expected
    like = wide_init()
    for step in expected:
        restored = restore(directory, step, like=like)
        assert int(restored.state["n"]) == step
        for key in ("w", "n"):
            got, want = np.asarray(restored.state[key]), copies.copies[step][key]
            assert got.dtype == want.dtype and got.shape == want.shape
            assert got.tobytes() == want.tobytes(), (step, key)  # bit for bit
    assert not np.array_equal(copies.copies[expected[1]]["w"], copies.copies[expected[2]]["w"])


def test_files_are_complete_once_the_next_save_starts(tmp_path):
    directory = tmp_path / "ckpt"
    hook = jm.CheckpointSaverHook(directory, save_steps=1, max_to_keep=None)
    with jm.MonitoredSession(count_step, zero, hooks=[hook]) as sess:
        for _ in range(3):
            sess.run()
            assert sess.step - 1 in complete_steps(directory)  # the previous save is committed


# -- NaN ----------------------------------------------------------------------------------


def nan_at_3(state, batch):
    state = state + 1.0
    state = jnp.where(state == 3.0, jnp.nan, state)
    return state, {"loss": state * 2}


@pytest.mark.parametrize("saver_first", [False, True], ids=["nan-hook-first", "saver-first"])
@pytest.mark.parametrize("save_steps, last_step", [(1, 10), (2, 3)], ids=["periodic", "at-end"])
def test_no_checkpoint_holds_a_state_after_a_non_finite_step(save_steps, last_step, saver_first, tmp_path):
    directory = tmp_path / "ckpt"
    copies = CopyingListener()
    hook = jm.CheckpointSaverHook(directory, save_steps=save_steps, listeners=[copies], max_to_keep=None)
    hooks = [hook, jm.NanHook("loss")] if saver_first else [jm.NanHook("loss"), hook]
    with pytest.raises(jm.NanLossDuringTrainingError) as info:
        train(hooks, last_step=last_step, step_fn=nan_at_3, init_fn=float_zero)
    assert info.value.step == 3
    assert all(step < 3 for step in hook.saved_steps)
    assert all(step < 3 for step in copies.copies)  # a listener never even saw a save of it
    on_disk = complete_steps(directory)
    assert on_disk and max(on_disk) < 3
    for step in on_disk:
        value = float(restore(directory, step, like=float_zero()).state)
        assert math.isfinite(value) and value == step


@pytest.mark.parametrize("save_steps, last_step", [(1, 10), (5, 3)], ids=["periodic", "at-end"])
def test_a_nan_hook_that_stops_cleanly_leaves_no_non_finite_checkpoint(save_steps, last_step, tmp_path):
    # CheckpointSaverHook promises "a NaN check has passed on every state that is saved";
    # NanHook(fail_on_nan_loss=False) fails the check and stops the loop cleanly, so the
    # non-finite state of step 3 must not become the checkpoint a restart resumes from.
    directory = tmp_path / "ckpt"
    hook = jm.CheckpointSaverHook(directory, save_steps=save_steps, max_to_keep=None)
    sess = train([jm.NanHook("loss", fail_on_nan_loss=False), hook], last_step=last_step, step_fn=nan_at_3,
                 init_fn=float_zero)
    assert sess.step == 3  # stopped cleanly after the non-finite step
    saved = {step: float(restore(directory, step, like=float_zero()).state) for step in complete_steps(directory)}
    assert saved and all(math.isfinite(value) for value in saved.values()), saved


# -- metadata -----------------------------------------------------------------------------


def test_the_metadata_of_a_checkpoint(tmp_path):
    import importlib.metadata

    import orbax.checkpoint as ocp

    directory = tmp_path / "ckpt"
    arrays = {"x": np.arange(20, dtype=np.float32)}

    def source():
        return jm.ArrayDataSource(arrays, batch_size=3, seed=7)

    def step_fn(state, batch):
        return state + 1, {"loss": batch["x"].sum()}

    config = {"lr": 0.1, "layers": [2, 3], "name": "tiny", "nested": {"ok": True}}
    hook = jm.CheckpointSaverHook(directory, save_steps=4, max_to_keep=None)
    train([hook], last_step=10, step_fn=step_fn, data=source(), config=config)
    assert hook.saved_steps == [0, 4, 8, 10]
    for step in hook.saved_steps:
        meta = restore(directory, step).meta
        expected_data = source()
        for _ in range(step):
            next(expected_data)
        assert meta["format"] == "jaxmon-checkpoint/1"
        assert meta["jax"] == jax.__version__ and meta["orbax"] == ocp.__version__
        assert meta["jaxmon"] == importlib.metadata.version("jaxmon")
        assert meta["step"] == step
        assert meta["data"] == expected_data.get_state()  # the position after `step` batches
        assert meta["hooks"]["StopAtStepHook"] == {"last_step": 10}
        assert meta["config"] == config
    # and the saved position resumes the data exactly
    resumed = source()
    resumed.set_state(restore(directory, 8).meta["data"])
    reference = source()
    for _ in range(8):
        next(reference)
    np.testing.assert_array_equal(next(resumed)["x"], next(reference)["x"])


# -- failed saves -------------------------------------------------------------------------


def fail_after_first(monkeypatch, owner, name, make_error=lambda: OSError("disk full (fake)")):
    """Lets the first call of owner.name through; every later one raises."""
    original = getattr(owner, name)
    calls = []

    if name == "_save_fn":
        async def failing(self, *args, **kwargs):
            calls.append(1)
            if len(calls) > 1:
                raise make_error()
            return await original(self, *args, **kwargs)
    else:
        def failing(self, *args, **kwargs):
            calls.append(1)
            if len(calls) > 1:
                raise make_error()
            return original(self, *args, **kwargs)

    monkeypatch.setattr(owner, name, failing)
    return calls


def test_a_save_that_fails_raises_from_run(monkeypatch, tmp_path):
    import jaxmon._checkpoints.manager

    calls = fail_after_first(monkeypatch, jaxmon._checkpoints.manager.ocp.CheckpointManager, "save")
    directory = tmp_path / "ckpt"
    hook = jm.CheckpointSaverHook(directory, save_steps=2)
    reached = []
    with pytest.raises(OSError, match=f"Saving checkpoint 2 to {directory} failed: OSError: disk full") as raised:
        with jm.MonitoredSession(count_step, zero, hooks=[hook]) as sess:
            while not sess.should_stop():
                sess.run()
                reached.append(sess.step)
    assert "the newest: 0" in str(raised.value) and isinstance(raised.value.__cause__, OSError)  # Orbax's error
    assert reached == [1] and sess.step == 2 and len(calls) == 2  # raised by the run of step 2
    assert complete_steps(directory) == [0]
    monkeypatch.undo()
    train([jm.CheckpointSaverHook(directory, save_steps=2)], last_step=3)  # the lock was released
    assert complete_steps(directory)[-1] == 3


def test_a_save_that_fails_at_end_raises_from_close(monkeypatch, tmp_path):
    import jaxmon._checkpoints.manager

    fail_after_first(monkeypatch, jaxmon._checkpoints.manager.ocp.CheckpointManager, "save")
    directory = tmp_path / "ckpt"
    loop_done = []
    with pytest.raises(OSError, match="disk full"):
        with jm.MonitoredSession(count_step, zero, hooks=[jm.CheckpointSaverHook(directory, save_steps=10),
                                                          jm.StopAtStepHook(last_step=3)]) as sess:
            while not sess.should_stop():
                sess.run()
            loop_done.append(sess.step)
    assert loop_done == [3] and complete_steps(directory) == [0]


@pytest.mark.parametrize("where", ["run", "close"])
def test_a_save_that_fails_in_the_background_is_raised_not_swallowed(where, monkeypatch, tmp_path):
    import orbax.checkpoint as ocp

    fail_after_first(monkeypatch, ocp.handlers.JsonCheckpointHandler, "_save_fn")  # writes meta
    directory = tmp_path / "ckpt"
    hook = jm.CheckpointSaverHook(directory, save_steps=2 if where == "run" else 100, async_save=True)
    loop_done = []
    with pytest.raises(OSError, match="disk full") as info:
        with jm.MonitoredSession(count_step, zero, hooks=[hook, jm.StopAtStepHook(last_step=6 if where == "run"
                                                                                   else 2)]) as sess:
            while not sess.should_stop():
                sess.run()
            loop_done.append(sess.step)
    notes = " ".join(getattr(info.value, "__notes__", []))
    if where == "run":  # the failed save of step 2 surfaces at the first run once it failed (at 4 at the latest)
        assert not loop_done and 2 <= sess.step <= 4 and ("training stopped there" in notes or "after_run" in notes)
    else:  # the save at end fails while the session closes cleanly
        assert loop_done == [2] and "close" in notes
    assert complete_steps(directory) == [0]  # the failed checkpoint is never listed


# -- restore from the hook's directory ----------------------------------------------------


def test_a_session_restores_from_the_hooks_directory_by_default(tmp_path):
    directory = tmp_path / "ckpt"
    concrete_calls = []

    def init_fn():
        state = jnp.zeros((), jnp.int32)
        if not isinstance(state, jax.core.Tracer):  # jax.eval_shape traces it for the restore target
            concrete_calls.append(1)
        return state

    def session():
        hook = jm.CheckpointSaverHook(directory, save_steps=2)
        return hook, jm.MonitoredSession(count_step, init_fn, hooks=[hook, jm.StopAtStepHook(num_steps=3)])

    hook, sess = session()
    assert sess.checkpoint_dir == os.fspath(directory)
    with sess:
        while not sess.should_stop():
            sess.run()
    assert len(concrete_calls) == 1 and hook.saved_steps == [0, 2, 3]

    hook, sess = session()
    assert len(concrete_calls) == 1  # restored, not initialised
    assert sess.step == 3 and int(sess.state) == 3
    assert hook.saved_steps == []  # the restored step is already saved
    with sess:
        while not sess.should_stop():
            sess.run()
    # num_steps was fixed by the first run (saved in its checkpoints): it stops at 3 at once
    assert sess.step == 3 and hook.saved_steps == []
    assert complete_steps(directory) == [0, 2, 3]

    hook = jm.CheckpointSaverHook(directory, save_steps=2, max_to_keep=None)
    sess = train([hook], last_step=7, init_fn=init_fn)
    assert len(concrete_calls) == 1
    # resumed at step 3 (saved at the end of the first run): the schedule is counted from step 0, so 4 and 6,
    # then 7 at the end
    assert hook.saved_steps == [4, 6, 7]
    assert complete_steps(directory) == [0, 2, 3, 4, 6, 7]
    assert [int(restore(directory, s).state) for s in (4, 6, 7)] == [4, 6, 7]


def test_preemption_saves_the_step_and_stops(tmp_path):
    directory = tmp_path / "ckpt"
    hook = jm.CheckpointSaverHook(directory, save_steps=100)
    with jm.MonitoredSession(count_step, zero, hooks=[hook]) as sess:
        sess.run()
        sess.request_preemption()
        sess.run()
        assert sess.should_stop() and sess.preemption_requested
        assert complete_steps(directory) == [0, 2]  # written before the loop goes on
    assert hook.saved_steps == [0, 2]  # and not again at end
    assert int(restore(directory, 2).state) == 2


def test_a_save_cut_off_by_stop_grace_period_secs_never_lands_in_another_writers_directory(monkeypatch, tmp_path):
    # close() waits for the save in flight at most stop_grace_period_secs ("it may be
    # lost"), then releases the directory. The one-writer lock exists "so that two runs
    # never interleave their checkpoints": either the directory stays locked while the
    # cut-off save may still commit, or that save never commits into it afterwards.
    import threading

    import orbax.checkpoint as ocp

    handler = ocp.handlers.JsonCheckpointHandler
    original, release, calls = handler._save_fn, threading.Event(), []

    async def slow(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 2:  # the first run's save at end hangs until the test lets it go
            release.wait(10)
        return await original(self, *args, **kwargs)

    monkeypatch.setattr(handler, "_save_fn", slow)
    directory = tmp_path / "ckpt"
    first = jm.MonitoredSession(count_step, zero, stop_grace_period_secs=0.3,
                                hooks=[jm.CheckpointSaverHook(directory, save_steps=100),
                                       jm.StopAtStepHook(last_step=2)])
    while not first.should_stop():
        first.run()
    try:
        start = time.monotonic()
        with pytest.raises(TimeoutError, match="stop_grace_period_secs"):
            first.close()
        assert time.monotonic() - start < 3  # bounded by the grace period, not by the hung save
        try:
            second = jm.MonitoredSession(count_step, zero, hooks=[jm.CheckpointSaverHook(directory, save_steps=100)])
        except RuntimeError as error:  # still locked while the cut-off save may commit: fine
            assert os.fspath(directory) in str(error)
        else:
            assert second.step == 0
            release.set()
            time.sleep(0.5)  # the cut-off save of the first run is free to finish now
            second.close()
            assert complete_steps(directory) == [0]  # nothing of the first run landed in the second's directory
    finally:
        release.set()
        time.sleep(0.3)  # let the abandoned background save end before the next test


def test_max_to_keep_applies_across_a_resume(tmp_path):
    directory = tmp_path / "ckpt"
    train([jm.CheckpointSaverHook(directory, save_steps=1, max_to_keep=2)], last_step=3)
    assert complete_steps(directory) == [2, 3]
    hook = jm.CheckpointSaverHook(directory, save_steps=1, max_to_keep=2)
    sess = train([hook], last_step=6)
    assert hook.saved_steps == [4, 5, 6] and sess.step == 6
    assert complete_steps(directory) == [5, 6]


def test_a_run_resumed_from_before_a_broken_latest_checkpoint_saves_past_it(tmp_path):
    # MonitoredSession: "A broken latest checkpoint is reported and the one before it is
    # used". The resumed run then reaches the broken checkpoint's step again and must be
    # able to save it (and go on), not fail on the broken directory left in the way.
    directory = tmp_path / "ckpt"
    train([jm.CheckpointSaverHook(directory, save_steps=1, max_to_keep=None)], last_step=5)
    assert complete_steps(directory) == [0, 1, 2, 3, 4, 5]
    with open(directory / "5" / "meta" / "metadata", "w") as f:
        f.write("{ cut off")
    hook = jm.CheckpointSaverHook(directory, save_steps=1, max_to_keep=None)
    with jm.MonitoredSession(count_step, zero, hooks=[hook, jm.StopAtStepHook(last_step=7)]) as sess:
        assert sess.step == 4 and int(sess.state) == 4  # fell back to step 4
        while not sess.should_stop():
            sess.run()
    assert hook.saved_steps == [5, 6, 7]
    assert [int(restore(directory, s).state) for s in (5, 6, 7)] == [5, 6, 7]


@pytest.mark.parametrize("interruption, saved", [(KeyboardInterrupt, [0, 3, 4]), (ZeroDivisionError, [0, 3])])
def test_a_ctrl_c_or_an_error_exit_still_commits_the_save_in_flight(interruption, saved, tmp_path):
    """An error skips `end` (no final save, as in TF); a KeyboardInterrupt saves the step
    it stopped on (unlike TF), then propagates. The async save that was started goes to
    disk before the exception leaves the `with` block."""
    hook = jm.CheckpointSaverHook(tmp_path, save_steps=3)
    with pytest.raises(interruption):
        with jm.MonitoredSession(count_step, zero, hooks=[hook]) as sess:
            for _ in range(4):
                sess.run()  # saves 0 and 3
            raise interruption()
    assert hook.saved_steps == saved and complete_steps(tmp_path) == saved
    assert float(restore(tmp_path, 3).state) == 3.0
    again = jm.CheckpointSaverHook(tmp_path, save_steps=3)
    again.begin()  # would raise if the lock had not been released
    again.close()


def test_saving_compiles_nothing_more_and_a_resumed_run_compiles_once(tmp_path):
    hooks = [jm.CheckpointSaverHook(tmp_path, save_steps=2, keep_best=1, best_metric="loss")]
    first = train(hooks, last_step=5, step_fn=metric_step(1))
    second = train([jm.CheckpointSaverHook(tmp_path, save_steps=2, keep_best=1, best_metric="loss")], last_step=9,
                   step_fn=metric_step(1))
    assert (first.compile_count, second.compile_count) == (1, 1) and second.step == 9
