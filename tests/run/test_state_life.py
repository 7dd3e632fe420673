"""The state's life on its own: `StateLife` building a fresh state or restoring one from
a real small checkpoint (written once for the module by a `MonitoredSession` with a
`CheckpointSaverHook`), with its step, data position and hook states; what a checkpoint
holds (`resume_info`, `snapshot`, `reject`); which hook is the saver; and a state given
with `state=`, which cannot be made twice."""

from __future__ import annotations

import logging
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import Counter, Plain

import jaxmon as jm
from jaxmon._checkpoints import manager as _checkpoint
from jaxmon._checkpoints import step_dirs as _step_dirs
from jaxmon._metrics.accumulators import Accumulators
from jaxmon._ops.time_spent import TimeSpent
from jaxmon._run.batches import BatchSource
from jaxmon._run.state_life import Snapshot, StateLife, _hook_keys


class Keeper(jm.Hook):
    """Counts its runs from `n`; saves and takes back the count."""

    def __init__(self, n=0):
        self.n, self.restored = n, None

    def after_run(self, ctx, values):
        self.n += 1

    def get_state(self):
        return {"n": self.n}

    def set_state(self, state):
        self.restored, self.n = state, state["n"]


class Other(Keeper):
    """A hook of another class, with its own key."""


class OldTimed(jm.Hook):
    """An older hook: a timer and no get_state, relying on the old default that saved it."""

    def __init__(self):
        self.timer = jm.SecondOrStepTimer(every_steps=2)

    def after_run(self, ctx, values):
        self.timer.due(values.step)


class Newcomer(jm.Hook):
    def get_state(self):
        return {"new": True}


def add(state, batch):
    return state + batch["x"], {"loss": state}


def zero():
    return jnp.zeros((), jnp.float32)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """A directory with the checkpoints of steps 0, 2 and 3 of a run over `Counter`."""
    directory = tmp_path_factory.mktemp("run")
    hooks = [jm.CheckpointSaverHook(directory, save_steps=2), Keeper(), Keeper(100), Other(50), OldTimed()]
    sess = jm.MonitoredSession(add, zero, data=Counter(), hooks=hooks, config={"lr": 0.1})
    for _ in range(3):
        sess.run()
    sess.close()
    assert _checkpoint.complete_steps(directory) == [0, 2, 3]
    return directory


def life(checkpoint_dir=None, hooks=(), data=None, init_fn=zero, state=None, initial_step=0, config=None,
         spent=None):
    return StateLife(init_fn, state, placement=None, checkpoint_dir=checkpoint_dir, warm_start=None,
                     initial_step=initial_step, config=config, hooks=tuple(hooks),
                     batches=BatchSource(data, 1, lambda step, limit: limit, prefetch=0),
                     accumulators=Accumulators(hooks), max_recoveries=0,
                     spent=spent)


def create(state_life, recovering=None):
    """The (state, step) `create` passes to its `ready`."""
    made = []
    state_life.create(lambda state, step: made.append((state, step)), recovering=recovering)
    [(state, step)] = made
    return state, step


# -- fresh or restored -----------------------------------------------------------------------------


def test_without_checkpoints_a_fresh_state_is_built_at_the_initial_step(tmp_path):
    calls = []

    def init_fn():
        calls.append(1)
        return np.float32(4.0)

    for directory in (None, tmp_path / "empty"):
        state_life = life(directory, init_fn=init_fn, initial_step=7, data=Counter())
        state, step = create(state_life)
        assert step == 7 and float(state) == 4.0
        assert isinstance(state, jax.Array) and state.committed  # as a restored one would be
        assert state_life.restored_step is None and not state_life.data_rewound
    assert len(calls) == 2


def test_a_fresh_state_is_init_time_and_a_restored_one_restore_time(tmp_path, checkpoints):
    def slow_init():
        time.sleep(0.05)
        return zero()

    spent = TimeSpent()
    create(life(tmp_path / "empty", init_fn=slow_init, spent=spent))
    assert spent.secs["init"] >= 0.05 and spent.secs["restore"] == 0.0  # nothing restored: none of it is restore time
    spent = TimeSpent()
    create(life(checkpoints, init_fn=slow_init, spent=spent))
    assert spent.secs["restore"] > 0.0 and spent.secs["init"] == 0.0


def test_the_latest_checkpoint_is_restored_with_its_step_and_data_position(checkpoints):
    data = Counter()
    state_life = life(checkpoints, data=data)
    state, step = create(state_life)
    assert (step, float(state)) == (3, 6.0)  # 1 + 2 + 3
    assert state_life.restored_step == 3 and state_life.data_rewound
    assert data.i == 3  # the first batch not run is the 4th
    assert state_life.checkpoint_dir == str(checkpoints)


def test_data_without_set_state_is_not_rewound_and_says_so(checkpoints, caplog):
    data = Plain()
    state_life = life(checkpoints, data=data)
    with caplog.at_level(logging.WARNING, logger="jaxmon"):
        create(state_life)
    assert state_life.restored_step == 3 and not state_life.data_rewound and data.i == 0
    assert "Checkpoint 3 holds a data position, but this session's data has no set_state()" in caplog.text


def test_hook_states_come_back_by_class_name_whatever_hooks_of_other_classes_came_in_between(checkpoints):
    first, second, other, old = Keeper(), Keeper(), Other(), OldTimed()
    hooks = [Newcomer(), first, jm.Hook(), second, Newcomer(), other, old]  # new hooks, another order
    create(life(checkpoints, hooks=hooks, data=Counter()))
    assert (first.n, second.n, other.n) == (3, 103, 53)
    assert old.timer.last_triggered_step() == 3  # the legacy save of its timer, taken back
    assert [key for key, _ in _hook_keys(tuple(hooks))] == ["Newcomer", "Keeper", "Hook", "Keeper#2", "Newcomer#2",
                                                           "Other", "OldTimed"]


def test_a_recovery_restores_state_and_data_but_leaves_the_hooks_their_own_state(checkpoints):
    class Saver(jm.Hook):
        checkpoint_dir = str(checkpoints)
        waited = 0

        def wait_until_finished(self):
            Saver.waited += 1

    keeper, data = Keeper(9), Counter()
    state_life = life(None, hooks=[Saver(), keeper], data=data)
    state, step = create(state_life, recovering=jm.AbortedError("a peer restarted"))
    assert (step, float(state)) == (3, 6.0) and data.i == 3 and state_life.data_rewound
    assert Saver.waited == 1  # the save in flight is waited for first
    assert keeper.n == 9 and keeper.restored is None


def test_the_saved_metadata_holds_the_versions_step_data_hooks_and_config(checkpoints):
    meta = _step_dirs.read_meta(checkpoints / "2")
    assert {"format", "jaxmon", "jax", "orbax", "time"} <= set(meta) and meta["jax"] == jax.__version__
    assert meta["step"] == 2 and meta["data"] == {"i": 2} and meta["config"] == {"lr": 0.1}
    assert meta["hooks"]["Keeper"] == {"n": 2} and meta["hooks"]["Keeper#2"] == {"n": 102}
    assert meta["hooks"]["OldTimed"] == {"timer": {"last_step": 1}}
    assert meta["hooks"]["CheckpointSaverHook"] == {"timer": {"last_step": 2, "waited": None}}  # a step timer


# -- what a checkpoint holds -------------------------------------------------------------------------


def test_resume_info_holds_every_hook_state_by_key_and_the_data_position():
    class Quiet(jm.Hook):  # its own get_state says None: nothing saved, no fallback to its timer
        def __init__(self):
            self.timer = jm.SecondOrStepTimer(every_steps=5)

        def get_state(self):
            return None

    old, quiet, data = OldTimed(), Quiet(), Counter()
    old.timer.update_last_triggered_step(5)
    quiet.timer.update_last_triggered_step(5)
    next(data)
    state_life = life(hooks=[Keeper(1), Keeper(2), jm.Hook(), old, quiet], data=data, config={"a": [1, 2]})
    info = state_life.resume_info(12)
    assert info["step"] == 12 and info["data"] == {"i": 1} and info["config"] == {"a": [1, 2]}
    assert info["hooks"] == {"Keeper": {"n": 1}, "Keeper#2": {"n": 2}, "OldTimed": {"timer": {"last_step": 5}}}
    assert life().resume_info(0)["data"] is None and life().resume_info(0)["config"] is None


def test_what_a_checkpoint_holds_must_be_json():
    with pytest.raises(TypeError, match="config must be JSON-serialisable"):
        life(config={"lr": object()})

    class Bad(jm.Hook):
        def get_state(self):
            return {"array": np.zeros(2)}

    with pytest.raises(TypeError, match=r"the checkpoint metadata \(data get_state\(\) and hooks' get_state\(\)\)"):
        life(hooks=[Bad()]).resume_info(0)


def test_reject_keeps_the_first_reason_until_the_next_create():
    state_life = life()
    create(state_life)
    assert state_life.rejected is None
    state_life.reject("a NaN at step 4")
    state_life.reject("another reason")
    assert state_life.rejected == "a NaN at step 4"
    create(state_life)
    assert state_life.rejected is None


def test_snapshot_syncs_first_and_is_none_when_rejected(caplog):
    state_life, synced = life(hooks=[Keeper(3)]), []
    snapshot = state_life.snapshot("state", 5, sync=lambda: synced.append(1))
    assert isinstance(snapshot, Snapshot) and synced == [1]
    assert (snapshot.step, snapshot.state) == (5, "state") and snapshot.meta["hooks"] == {"Keeper": {"n": 3}}
    state_life.reject("a NaN at step 4")
    with caplog.at_level(logging.WARNING, logger="jaxmon"):
        assert state_life.snapshot("state", 6, sync=lambda: synced.append(2)) is None
    assert synced == [1, 2] and "Not saving a checkpoint of step 6: a NaN at step 4." in caplog.text


def test_snapshot_raises_what_the_sync_raised():
    def sync():
        raise jm.NanLossDuringTrainingError("NaN loss")

    with pytest.raises(jm.NanLossDuringTrainingError, match="NaN loss"):
        life().snapshot("state", 1, sync=sync)


def test_a_sync_that_rejects_the_state_makes_snapshot_none():
    state_life = life()
    assert state_life.snapshot("s", 3, sync=lambda: state_life.reject("NaN found by a late check")) is None


# -- the state= argument and the saver ---------------------------------------------------------------


def test_a_state_given_with_state_is_used_once_and_cannot_be_made_again_on_recovery():
    given = jnp.float32(2.0)
    state_life = life(init_fn=None, state=given)
    state, step = create(state_life)
    assert float(state) == 2.0 and step == 0
    error = jm.AbortedError("a peer restarted")
    with pytest.raises(jm.AbortedError, match="a peer restarted") as raised:
        create(state_life, recovering=error)
    assert raised.value is error
    assert any("cannot re-create a state given with state=: pass init_fn=" in note for note in raised.value.__notes__)


def test_a_state_given_with_state_is_restored_like_itself(checkpoints):
    state, step = create(life(checkpoints, init_fn=None, state=jnp.float32(0.0), data=Counter()))
    assert (step, float(state)) == (3, 6.0)


def test_the_saver_is_the_first_hook_with_a_checkpoint_dir_and_wait_until_finished():
    class DirOnly(jm.Hook):
        checkpoint_dir = "/not/a/saver"

    class Saver(jm.Hook):
        def __init__(self, directory):
            self.checkpoint_dir = directory

        def wait_until_finished(self):
            pass

    class NoneDir(Saver):
        pass

    hooks = [DirOnly(), NoneDir(None), Saver("/first"), Saver("/second")]
    assert life(hooks=hooks).checkpoint_dir == "/first"
    assert life("/given", hooks=hooks).checkpoint_dir == "/given"  # the session's own comes first
    assert life(hooks=[DirOnly()]).checkpoint_dir is None
    assert life(hooks=[jm.CheckpointSaverHook("/saver", save_steps=1)]).checkpoint_dir == "/saver"
