"""MonitoredTrainingSession: TF's standard training services on a MonitoredSession
(checkpoints, summaries, step counts, chief and non-chief) and Supervisor's extras.

The JAX mapping: the step number is a host int saved in every checkpoint, so "the
counter reads N after a restart" is the step of the re-created session (and the
state's own step count, which the checkpoint restored with it). There is no graph:
TF's `save_graph_def` maps to "no such argument, and nothing like graph.pbtxt or .meta
is written"; TF's distribute-coordinator worker maps to `is_chief=False`.
Every test reads its files back: checkpoints with jm.restore_checkpoint and the
directory listing, summaries with TensorBoard's own EventAccumulator and
metrics.jsonl.
"""

from __future__ import annotations

import json
import os
import re
import time

import jax.numpy as jnp
import numpy as np
import pytest
from helpers import RecordingHook, events, window_means
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import jaxmon as jm
from jaxmon._checkpoints.manager import complete_steps
from jaxmon.hooks._throughput import Throughput

SIZE_GUIDANCE = {"scalars": 0, "histograms": 0, "images": 0, "tensors": 0}


# -- shared pieces ---------------------------------------------------------------------------


def step_fn(state, batch):
    """A 2-leaf state: `w` converges to 2, `n` counts the steps the state has seen."""
    w = state["w"] * 0.5 + 1.0
    n = state["n"] + 1
    return {"w": w, "n": n}, {"loss": w, "n": n}


def init_fn():
    return {"w": jnp.zeros((), jnp.float32), "n": jnp.zeros((), jnp.int32)}


def loss_at(step):
    """The `loss` output of step `step` (w_k = 2 - 2**(1 - k))."""
    return 2.0 - 2.0 ** (1 - step)


def train(steps, sleep_after=None, **kwargs):
    """Runs `steps` steps of a MonitoredTrainingSession (sleeping `sleep_after[i]`
    seconds after run i where given) and closes it."""
    with jm.MonitoredTrainingSession(step_fn, init_fn, **kwargs) as sess:
        for i in range(steps):
            sess.run()
            if sleep_after and i in sleep_after:
                time.sleep(sleep_after[i])
    return sess


def restarted(directory, **kwargs):
    """Re-creates a training session on `directory` and closes it: (its step, the
    restored state's own count of steps)."""
    with jm.MonitoredTrainingSession(step_fn, init_fn, checkpoint_dir=directory, **kwargs) as sess:
        return sess.step, int(sess.state["n"])


def saver_of(sess):
    (saver,) = [hook for hook in sess.hooks if isinstance(hook, jm.CheckpointSaverHook)]
    return saver


def hook_types(sess):
    return [type(hook) for hook in sess.hooks]


def read_events(logdir):
    acc = EventAccumulator(os.fspath(logdir), size_guidance=SIZE_GUIDANCE)
    acc.Reload()
    return acc


def scalar_steps(acc, tag):
    return [e.step for e in acc.Scalars(tag)]


def texts(acc, tag):
    return [(e.step, e.tensor_proto.string_val[0].decode()) for e in acc.Tensors(f"{tag}/text_summary")]


def jsonl(logdir):
    with open(os.path.join(logdir, "metrics.jsonl"), encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def event_files(logdir):
    return sorted(name for name in os.listdir(logdir) if name.startswith("events.out.tfevents"))


def snapshot(directory):
    """Every file under `directory` with its size and modification time."""
    found = {}
    for root, _, files in os.walk(directory):
        for name in files:
            path = os.path.join(root, name)
            info = os.stat(path)
            found[os.path.relpath(path, directory)] = (info.st_size, info.st_mtime_ns)
    return found


def files_open_under(directory):
    """The files under `directory` this process holds open (Linux /proc)."""
    directory = os.path.realpath(directory)
    held = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(directory + os.sep):
            held.append(target)
    return held


@pytest.fixture(scope="module")
def trained_dir(tmp_path_factory):
    """A run directory whose latest checkpoint is step 3 (read only by the tests using it)."""
    directory = tmp_path_factory.mktemp("trained")
    train(3, checkpoint_dir=directory, save_checkpoint_steps=1)
    assert complete_steps(directory) == [0, 1, 2, 3]
    return directory


# -- defaults, final checkpoint at close -----------------------------------------------------


def test_default_arguments_restart_finds_the_final_checkpoint(tmp_path):
    sess = train(2, checkpoint_dir=tmp_path)
    assert sess.is_chief is True  # is_chief=None: jax.process_index() == 0
    assert hook_types(sess) == [jm.StepCounterHook, jm.SummarySaverHook, jm.GoodputHook, Throughput,
                                jm.CheckpointSaverHook]
    # The 600 s default period never elapsed: step 0 at creation, step 2 at close.
    assert saver_of(sess).saved_steps == [0, 2]
    assert complete_steps(tmp_path) == [0, 2]
    assert jm.latest_checkpoint_step(tmp_path) == 2
    assert restarted(tmp_path) == (2, 2)


# -- save_checkpoint_steps -------------------------------------------------------------------


@pytest.mark.parametrize("every, saved", [(100, [0, 100]), (40, [0, 40, 80, 100])])
def test_save_checkpoint_steps_restart_reads_100(tmp_path, every, saved):
    sess = train(100, checkpoint_dir=tmp_path, save_checkpoint_steps=every)
    assert saver_of(sess).saved_steps == saved  # the last step is saved once, not again at close
    assert complete_steps(tmp_path) == saved
    assert jm.latest_checkpoint_step(tmp_path) == 100
    for step in saved:
        restored = jm.restore_checkpoint(tmp_path, step=step, like=init_fn())
        assert (restored.step, restored.meta["step"], int(restored.state["n"])) == (step, step, step)
        assert float(restored.state["w"]) == pytest.approx(0.0 if step == 0 else loss_at(step))
    assert restarted(tmp_path) == (100, 100)


# -- save_checkpoint_secs --------------------------------------------------------------------


def test_save_checkpoint_secs_restart_reads_11(tmp_path):
    # The session takes no clock (its hooks do), so this uses TF's real 0.1 s period and
    # 0.2 s sleep. The sleep guarantees a timed save at step 2, whatever the machine speed.
    sess = train(11, sleep_after={0: 0.2}, checkpoint_dir=tmp_path, save_checkpoint_secs=0.1, max_to_keep=None)
    saved = saver_of(sess).saved_steps
    assert saved[0] == 0 and 2 in saved and saved[-1] == 11
    assert saved == sorted(set(saved))
    assert complete_steps(tmp_path) == saved  # max_to_keep=None keeps them all
    assert restarted(tmp_path) == (11, 11)


# -- checkpoints off, chief-only hook ----------------------------------------------------------


@pytest.mark.parametrize("off", [{"save_checkpoint_secs": 0}, {"save_checkpoint_secs": None},
                                 {"save_checkpoint_steps": 0}])
def test_checkpoints_off_writes_none_and_chief_only_hook_begins_once(tmp_path, off):
    chief_hook = RecordingHook("chief")
    sess = train(3, checkpoint_dir=tmp_path, chief_only_hooks=[chief_hook], **off)
    assert jm.CheckpointSaverHook not in hook_types(sess)
    assert chief_hook.calls["begin"] == 1
    assert chief_hook.calls["after_run"] == 3 and chief_hook.calls["end"] == 1
    assert complete_steps(tmp_path) == []
    assert jm.latest_checkpoint_step(tmp_path) is None
    assert event_files(tmp_path)  # summaries still go to checkpoint_dir
    assert restarted(tmp_path, **off) == (0, 0)


# -- summaries and global_step/sec -----------------------------------------------------------


@pytest.mark.parametrize("period", [{"save_summaries_steps": 100}, {"save_summaries_secs": 0.1}])
def test_summaries_hold_the_output_tags_and_global_step_per_sec(tmp_path, period):
    sess = train(101, checkpoint_dir=tmp_path, log_step_count_steps=10, **period)
    assert sess.step == 101
    assert len(event_files(tmp_path)) == 1  # every hook shares the directory's one event file
    acc = read_events(tmp_path)
    assert {"loss", "n", "global_step/sec"} <= set(acc.Tags()["scalars"])
    loss = [(e.step, e.value) for e in acc.Scalars("loss")]
    if "save_summaries_steps" in period:
        assert [step for step, _ in loss] == [1, 100]  # step 1, then every 100 steps counted from step 0
    else:  # step 1 always writes; later steps every 0.1 s
        assert loss[0][0] == 1 and all(1 <= step <= 101 for step, _ in loss)
    # the default SummarySaverHook writes each output's mean since its previous write, but the write at
    # step 1 (the starting point) ends no window: the next covers the steps from 1, e.g. at step 100 the mean
    # of loss_at(1..100), (200 - 2 * (1 - 2**-100)) / 100 = 1.98 (as float32); for seconds, e.g. at step 2
    # (1 + 1.5) / 2 = 1.25
    steps = [step for step, _ in loss]
    means = window_means({t: loss_at(t) for t in range(1, 102)}, steps)
    assert means[0] == loss_at(1) == 1.0  # step 1 alone
    if "save_summaries_steps" in period:
        assert means == pytest.approx([1.0, 1.98], rel=1e-12)  # the second over steps 1-100, not 2-100
    assert [value for _, value in loss] == pytest.approx(means, rel=1e-6)
    assert [(e.step, e.value) for e in acc.Scalars("n")][0] == (1, 1.0)
    # The clock starts after step 1 (which compiles): rates at 10, 20, ..., 100, the first over steps 2-10.
    rates = acc.Scalars("global_step/sec")
    assert [e.step for e in rates] == list(range(10, 101, 10))
    assert all(e.value > 0 for e in rates)
    lines = jsonl(tmp_path)
    first = next(line for line in lines if "loss" in line)
    assert (first["step"], first["loss"], first["n"]) == (1, 1.0, 1)
    assert [line["step"] for line in lines if "global_step/sec" in line] == list(range(10, 101, 10))


# -- no graph ------------------------------------------------------------------------------------


def test_there_is_no_graph_to_save(tmp_path):
    with pytest.raises(TypeError, match="save_graph_def"):
        jm.MonitoredTrainingSession(step_fn, init_fn, checkpoint_dir=tmp_path / "refused", save_graph_def=True)
    assert not (tmp_path / "refused").exists()
    sess = train(1, checkpoint_dir=tmp_path / "run", save_checkpoint_steps=1)
    assert saver_of(sess).saved_steps == [0, 1]
    written = snapshot(tmp_path / "run")
    assert any(path.startswith("1" + os.sep) for path in written)
    assert not [path for path in written if path.endswith((".pbtxt", ".meta", ".pb"))]


# -- not the chief ---------------------------------------------------------------------------------


def test_non_chief_runs_only_the_user_hooks_and_still_restores(trained_dir):
    before = snapshot(trained_dir)
    user, chief_only = RecordingHook("user"), RecordingHook("chief")
    with jm.MonitoredTrainingSession(step_fn, init_fn, checkpoint_dir=trained_dir, is_chief=False,
                                     hooks=[user], chief_only_hooks=[chief_only], save_checkpoint_steps=1,
                                     save_summaries_steps=1, log_step_count_steps=1,
                                     config={"role": "worker"}) as sess:
        assert sess.is_chief is False
        assert sess.hooks == (user,)
        assert (sess.step, int(sess.state["n"])) == (3, 3)  # restored from the chief's checkpoint
        assert sess.summary_dir is None
        for _ in range(2):
            sess.run()
        with pytest.raises(RuntimeError, match="summary writer"):
            sess.summary_computed({"x": 1.0})
    assert sess.step == 5 and int(sess.state["n"]) == 5
    assert chief_only.calls == {}
    assert [user.calls[e] for e in ("begin", "after_create_session", "after_run", "end")] == [1, 1, 2, 1]
    assert snapshot(trained_dir) == before  # nothing written: no checkpoint, summary or config


def test_non_chief_on_an_empty_directory_starts_fresh_and_creates_nothing(tmp_path):
    sess = train(2, checkpoint_dir=tmp_path / "ckpt", summary_dir=tmp_path / "summaries", is_chief=False)
    assert sess.hooks == ()
    assert sess.step == 2 and int(sess.state["n"]) == 2
    assert os.listdir(tmp_path) == []


def test_non_chief_restores_the_user_hooks_state_as_the_chief_does(tmp_path):
    """Hook states are saved under keys by position in the session's hook list; the
    chief has 3 standard hooks before the user's, a non-chief none. So a non-chief (in a
    multi-process job: every process but 0, whose metadata is the one saved) does not get
    its user hooks' state back, and a StopAtStepHook(num_steps=...) there stops at another
    step than on the chief."""
    with jm.MonitoredTrainingSession(step_fn, init_fn, checkpoint_dir=tmp_path,
                                     hooks=[jm.StopAtStepHook(num_steps=3)]) as sess:
        while not sess.should_stop():
            sess.run()
    assert sess.step == 3 and complete_steps(tmp_path) == [0, 3]
    last_steps = {}
    for is_chief in (True, False):
        stop = jm.StopAtStepHook(num_steps=3)
        with jm.MonitoredTrainingSession(step_fn, init_fn, checkpoint_dir=tmp_path, is_chief=is_chief,
                                         hooks=[stop]) as resumed:
            assert resumed.step == 3
            last_steps[is_chief] = (stop.last_step, resumed.should_stop())
    assert last_steps[True] == (3, True)  # the chief resumes the run that ended at 3: it stops at once
    assert last_steps[False] == last_steps[True]


# -- periods: both given, off, defaults --------------------------------------------------------


@pytest.mark.parametrize("both", [
    {"save_checkpoint_secs": 60, "save_checkpoint_steps": 10},
    {"save_summaries_steps": 10, "save_summaries_secs": 60},
], ids=["checkpoints", "summaries"])
def test_both_periods_of_one_service_is_a_value_error_naming_both(tmp_path, both):
    with pytest.raises(ValueError, match="Can not provide both") as info:
        jm.MonitoredTrainingSession(step_fn, init_fn, checkpoint_dir=tmp_path / "run", **both)
    for name, value in both.items():
        assert f"{name}={value!r}" in str(info.value)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("kwargs", [
    {"save_checkpoint_steps": -1}, {"save_checkpoint_steps": 2.5}, {"save_checkpoint_steps": True},
    {"save_checkpoint_secs": -1.0}, {"save_summaries_steps": -5}, {"save_summaries_secs": "60"},
    {"log_step_count_steps": -1}, {"max_wait_secs": -1},
])
def test_bad_periods_are_value_errors_naming_the_argument(tmp_path, kwargs):
    (name,) = kwargs
    with pytest.raises(ValueError, match=name):
        jm.MonitoredTrainingSession(step_fn, init_fn, checkpoint_dir=tmp_path / "run", **kwargs)
    assert not (tmp_path / "run").exists()


# The periods resolve as TF's arguments did; the hooks keep them on jaxmon's schedule (`Every`: after
# steps N, 2N, ...; the summaries after step 1 too).
EVERY_100 = "Every(every_steps=100)"
SUMMARIES_EVERY_100 = "Every(every_steps=100, first=True)"


@pytest.mark.parametrize("kwargs, expected", [
    ({}, {"StepCounterHook": EVERY_100, "SummarySaverHook": SUMMARIES_EVERY_100, "GoodputHook": EVERY_100,
          "Throughput": EVERY_100, "CheckpointSaverHook": "Every(every_secs=600)"}),
    ({"save_checkpoint_secs": jm.USE_DEFAULT, "save_summaries_steps": jm.USE_DEFAULT},
     {"StepCounterHook": EVERY_100, "SummarySaverHook": SUMMARIES_EVERY_100, "GoodputHook": EVERY_100,
      "Throughput": EVERY_100, "CheckpointSaverHook": "Every(every_secs=600)"}),
    ({"save_summaries_secs": 30, "save_checkpoint_steps": 50},  # one given: the other off
     {"StepCounterHook": EVERY_100, "SummarySaverHook": "Every(every_secs=30, first=True)",
      "GoodputHook": "Every(every_secs=30)", "Throughput": "Every(every_secs=30)",
      "CheckpointSaverHook": "Every(every_steps=50)"}),
    ({"save_summaries_steps": 7, "save_checkpoint_secs": 30, "log_step_count_steps": 3},
     {"StepCounterHook": "Every(every_steps=3)", "SummarySaverHook": "Every(every_steps=7, first=True)",
      "GoodputHook": "Every(every_steps=7)", "Throughput": "Every(every_steps=7)",
      "CheckpointSaverHook": "Every(every_secs=30)"}),
    ({"save_checkpoint_steps": 50, "save_checkpoint_secs": 0, "save_summaries_steps": None,
      "save_summaries_secs": 20},  # a 0 or None beside a period turns only itself off
     {"StepCounterHook": EVERY_100, "SummarySaverHook": "Every(every_secs=20, first=True)",
      "GoodputHook": "Every(every_secs=20)", "Throughput": "Every(every_secs=20)",
      "CheckpointSaverHook": "Every(every_steps=50)"}),
    ({"save_summaries_steps": 0, "save_checkpoint_secs": None, "log_step_count_steps": 0}, {}),
    ({"save_summaries_steps": None, "save_summaries_secs": None, "save_checkpoint_steps": 0,
      "save_checkpoint_secs": 0, "log_step_count_steps": None}, {}),
], ids=["neither", "USE_DEFAULT", "one-given", "other-one-given", "zero-beside-one", "off", "all-off"])
def test_periods_resolve_as_tf_does(tmp_path, kwargs, expected):
    with jm.MonitoredTrainingSession(step_fn, init_fn, checkpoint_dir=tmp_path, **kwargs) as sess:
        timers = {type(hook).__name__: re.search(r"Every\([^)]*\)", repr(hook)).group(0)
                  for hook in sess.hooks}
    assert timers == expected
    order = ("StepCounterHook", "SummarySaverHook", "GoodputHook", "Throughput", "CheckpointSaverHook")
    assert list(timers) == [name for name in order
                            if name in expected]


def test_hook_order_on_the_chief(tmp_path):  # TF's order
    log = []
    chief = [RecordingHook("chief1", log), RecordingHook("chief2", log)]
    user = [RecordingHook("user1", log), RecordingHook("user2", log)]
    with jm.MonitoredTrainingSession(step_fn, init_fn, checkpoint_dir=tmp_path, hooks=user,
                                     chief_only_hooks=chief) as sess:
        sess.run()
    assert hook_types(sess) == [RecordingHook, RecordingHook, jm.StepCounterHook, jm.SummarySaverHook,
                                jm.GoodputHook, Throughput, jm.CheckpointSaverHook, RecordingHook, RecordingHook]
    assert sess.hooks[:2] == tuple(chief) and sess.hooks[7:] == tuple(user)
    order = ["chief1", "chief2", "user1", "user2"]
    for event in ("begin", "after_create_session", "before_run", "after_run", "end"):
        assert events(log, event) == order


def test_summary_dir_separates_summaries_from_checkpoints(tmp_path):
    ckpt, logs = tmp_path / "ckpt", tmp_path / "logs"
    train(3, checkpoint_dir=ckpt, summary_dir=logs, save_summaries_steps=2, save_checkpoint_steps=2)
    assert complete_steps(ckpt) == [0, 2, 3] and complete_steps(logs) == []
    assert event_files(logs) and not event_files(ckpt)
    assert not (ckpt / "metrics.jsonl").exists()
    assert scalar_steps(read_events(logs), "loss") == [1, 2]


# -- Supervisor's summary_computed -------------------------------------------------------------


def test_summary_computed_writes_into_the_sessions_event_file(tmp_path):
    with jm.MonitoredTrainingSession(step_fn, init_fn, checkpoint_dir=tmp_path, save_summaries_steps=2) as sess:
        for _ in range(3):
            sess.run()
        sess.summary_computed({"acc": 0.5, "note": "hello", "weights": np.arange(4.0),
                               "device_scalar": jnp.float32(2.5)})
        sess.summary_computed({"acc": 0.75}, step=10)
        sess.run()
    assert len(event_files(tmp_path)) == 1  # the one the hooks write
    acc = read_events(tmp_path)
    assert [(e.step, e.value) for e in acc.Scalars("acc")] == [(3, 0.5), (10, 0.75)]
    assert [(e.step, e.value) for e in acc.Scalars("device_scalar")] == [(3, 2.5)]
    assert texts(acc, "note") == [(3, "hello")]
    (weights,) = acc.Histograms("weights")
    assert (weights.step, weights.histogram_value.num, weights.histogram_value.min,
            weights.histogram_value.max, weights.histogram_value.sum) == (3, 4, 0.0, 3.0, 6.0)
    assert scalar_steps(acc, "loss") == [1, 2, 4]  # the hook's own summaries are still there
    lines = jsonl(tmp_path)
    assert [(line["step"], line["acc"]) for line in lines if "acc" in line] == [(3, 0.5), (10, 0.75)]
    assert [(line["step"], line["note"]) for line in lines if "note" in line] == [(3, "hello")]
    assert not [line for line in lines if "weights" in line]  # histograms stay out of the JSON lines


@pytest.mark.parametrize("kwargs", [
    {"is_chief": False, "checkpoint_dir": "ckpt", "summary_dir": "logs"},
    {},  # no checkpoint_dir, no summary_dir
    {"checkpoint_dir": None, "summary_dir": None, "save_summaries_steps": 1},
], ids=["non-chief", "no-dirs", "no-dirs-summaries-asked"])
def test_summary_computed_without_a_writer_is_a_runtime_error(tmp_path, monkeypatch, kwargs):
    monkeypatch.chdir(tmp_path)
    with jm.MonitoredTrainingSession(step_fn, init_fn, **kwargs) as sess:
        sess.run()
        with pytest.raises(RuntimeError, match="summary writer"):
            sess.summary_computed({"x": 1.0})
        assert sess.summary_dir is None
    assert os.listdir(tmp_path) == []


def test_summary_computed_takes_a_dict_of_tags(tmp_path):
    with jm.MonitoredTrainingSession(step_fn, init_fn, checkpoint_dir=tmp_path) as sess:
        for bad in ([("x", 1.0)], {1: 1.0}, 3.0):
            with pytest.raises(TypeError, match="tag"):
                sess.summary_computed(bad)


def test_summary_computed_after_close_leaves_no_file_open(tmp_path):
    sess = train(1, checkpoint_dir=tmp_path)
    assert files_open_under(tmp_path) == []
    files = event_files(tmp_path)
    try:
        sess.summary_computed({"late": 1.0})
    except RuntimeError:
        pass  # refusing a closed session is fine too
    # Either way the closed session must not hold a writer open (nor start a new event file).
    assert files_open_under(tmp_path) == []
    assert event_files(tmp_path) == files


# -- config ------------------------------------------------------------------------------------


def test_config_is_saved_in_every_checkpoint_and_written_once_as_text(tmp_path):
    config = {"lr": 0.1, "model": {"depth": 2, "name": "mlp"}, "tags": ["a", "b"]}
    train(4, checkpoint_dir=tmp_path, save_checkpoint_steps=2, config=config)
    assert complete_steps(tmp_path) == [0, 2, 4]
    for step in (0, 2, 4):
        assert jm.restore_checkpoint(tmp_path, step=step, like=init_fn()).meta["config"] == config
    (text,) = texts(read_events(tmp_path), "config")
    assert text[0] == 0 and json.loads(text[1]) == config
    assert [json.loads(line["config"]) for line in jsonl(tmp_path) if "config" in line] == [config]
    # A restart with the same config is the same run: not again; with another, filed under the step it resumes at.
    restarted(tmp_path, config=config)
    assert [step for step, _ in texts(read_events(tmp_path), "config")] == [0]
    restarted(tmp_path, config={**config, "lr": 0.2})
    assert [step for step, _ in texts(read_events(tmp_path), "config")] == [0, 4]


def test_config_must_be_json(tmp_path):
    with pytest.raises(TypeError, match="config"):
        jm.MonitoredTrainingSession(step_fn, init_fn, checkpoint_dir=tmp_path / "run", config={"f": object()})
    assert not (tmp_path / "run").exists()


def test_a_failed_config_summary_releases_the_checkpoint_dir(tmp_path):
    """The config summary is written after MonitoredSession.__init__ opened every hook;
    when it fails, the session must close them again (as a failing hook.begin does)."""
    (tmp_path / "file").write_text("")
    with pytest.raises(OSError):
        jm.MonitoredTrainingSession(step_fn, init_fn, checkpoint_dir=tmp_path / "ckpt",
                                    summary_dir=tmp_path / "file" / "logs", save_summaries_steps=0,
                                    log_step_count_steps=0, config={"lr": 0.1})
    # The checkpoint directory's writer lock must be free again for the next try.
    assert restarted(tmp_path / "ckpt", save_summaries_steps=0, log_step_count_steps=0) == (0, 0)
    assert files_open_under(tmp_path) == []


# -- warm start, PeriodicHook as Supervisor.loop --------------------------------------------------


def test_warm_start_applies_on_the_fresh_init_path_only(trained_dir, tmp_path):
    with jm.MonitoredTrainingSession(step_fn, init_fn, checkpoint_dir=tmp_path, warm_start=trained_dir) as sess:
        assert sess.step == 0 and int(sess.state["n"]) == 3  # the pre-trained leaves, a fresh step
        assert float(sess.state["w"]) == pytest.approx(loss_at(3))
        assert sorted(sess.warm_start_report.restored) == ["n", "w"]
        sess.run()
    with jm.MonitoredTrainingSession(step_fn, init_fn, checkpoint_dir=tmp_path, warm_start=trained_dir) as again:
        assert again.warm_start_report is None  # restored its own checkpoint instead
        assert (again.step, int(again.state["n"])) == (1, 4)


def test_periodic_hook_is_supervisors_timer_service(tmp_path):
    """Supervisor's `summary_op=None` + `loop(...)` pattern: the step's own summaries off,
    a PeriodicHook writes computed summaries."""
    calls = []

    def write_summary(session):
        calls.append(session.step)
        session.summary_computed({"manual": float(session.step) * 10})

    hook = jm.PeriodicHook(write_summary, every_n_steps=4, at_end=True)
    sess = train(10, checkpoint_dir=tmp_path, save_summaries_steps=None, log_step_count_steps=None, hooks=[hook])
    assert jm.SummarySaverHook not in hook_types(sess)
    assert calls == [4, 8, 10]  # after steps 4 and 8, and at the end (10)
    acc = read_events(tmp_path)
    assert [(e.step, e.value) for e in acc.Scalars("manual")] == [(s, 10.0 * s) for s in calls]
    assert "loss" not in acc.Tags()["scalars"]


def test_hooks_none_is_no_hooks_as_in_tf(tmp_path):
    with jm.MonitoredTrainingSession(lambda s, b: (s + b, {"loss": s}), state=jnp.zeros(()), data=[1.0, 2.0],
                                     checkpoint_dir=tmp_path, hooks=None, chief_only_hooks=None) as sess:
        while not sess.should_stop():
            sess.run()
    assert sess.step == 2 and jm.latest_checkpoint_step(tmp_path) == 2


def test_hparams_are_written_once_per_run_to_tensorboard_and_beside_metrics_jsonl(tmp_path):
    def session(hparams):
        return jm.MonitoredTrainingSession(lambda s, b: (s + 1, {"loss": s * 1.0}), lambda: jnp.zeros(()),
                                           checkpoint_dir=tmp_path, hparams=hparams, data=[{}] * 3)

    with session({"lr": 0.1, "model": {"width": 64}}) as sess:
        while not sess.should_stop():
            sess.run()
    assert json.loads((tmp_path / "hparams.json").read_text()) == {"lr": 0.1, "model.width": 64}
    header, *lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert json.loads(header) == {"hparams": {"lr": 0.1, "model.width": 64}}  # metrics.jsonl's first line
    records = [json.loads(line) for line in lines]
    assert [r["step"] for r in records if "loss" in r] == [1]  # summaries every 100 steps
    assert [r["step"] for r in records if "loss" not in r] == [3]  # the GoodputHook's last breakdown, at close
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    assert "_hparams_/session_start_info" in events.PluginTagToContent("hparams")  # the HParams dashboard
    assert "hparams/text_summary" in events.Tags()["tensors"]
    with session({"lr": 0.5}):  # resumed at step 3: the run's hyper-parameters stay those it started with
        pass
    assert json.loads((tmp_path / "hparams.json").read_text()) == {"lr": 0.1, "model.width": 64}
    assert (tmp_path / "metrics.jsonl").read_text().splitlines()[0] == header
    from jaxmon._cli.main import run_info

    assert run_info(str(tmp_path))["metrics"]["loss"] == (1, 0.0)  # `jaxmon inspect` reads past the header
    with pytest.raises(TypeError, match="hparams must be a dict"):
        session([("lr", 0.1)])
