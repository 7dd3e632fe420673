"""Resuming from real Orbax checkpoints: kill and resume, SIGTERM, broken and unfinished
checkpoints, restore-or-init and warm starts, shardings, exact data positions, recovery
from checkpoints (the state and the step restored together), plain-Orbax interop and
`checkpoints_iterator`.

Every test writes real checkpoints under `tmp_path` and reads the files back.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import warm_processes
from helpers import ROOT, RecordingHook, count_step, cpu_env, zero

import jaxmon as jm
from jaxmon._checkpoints import integrity as _integrity
from jaxmon._checkpoints.manager import complete_steps

TRAINER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "trainer.py")
CHILD_ENV = cpu_env()


# -- subprocess helpers ------------------------------------------------------------------


class Trainer:
    """tests/end_to_end/trainer.py in a subprocess; its stdout lines are read by a thread."""

    def __init__(self, checkpoint_dir, last_step, save_steps, out, delay=0.0):
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.printed: list[str] = []
        self.proc = warm_processes.popen(
            [sys.executable, TRAINER, str(checkpoint_dir), str(last_step), str(save_steps), str(out), str(delay)],
            cwd=ROOT, env=CHILD_ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self._stderr: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()
        threading.Thread(target=lambda: self._stderr.extend(self.proc.stderr), daemon=True).start()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.put(line.strip())
        self.lines.put(None)

    def _next_line(self, deadline):
        line = self.lines.get(timeout=max(0.01, deadline - time.monotonic()))
        if line is None:
            raise AssertionError(f"trainer ended early (rc={self.proc.wait(5)}): {self.printed}\n{self.stderr()}")
        self.printed.append(line)
        return line

    def wait_for_step(self, step, timeout=60.0):
        """Reads until it printed "step N" with N >= step; returns N."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self._next_line(deadline)
            except queue.Empty:
                raise AssertionError(f"no 'step {step}' within {timeout}s: {self.printed}\n{self.stderr()}") from None
            match = re.fullmatch(r"step (\d+)", line)
            if match and int(match.group(1)) >= step:
                return int(match.group(1))

    def finish(self, timeout=60.0):
        """Waits for the exit; returns the return code (all output is read)."""
        rc = self.proc.wait(timeout)
        while (line := self.lines.get(timeout=10)) is not None:
            self.printed.append(line)
        return rc

    def steps_printed(self):
        return [int(line.split()[1]) for line in self.printed if line.startswith("step ")]

    def start_step(self):
        [start] = [int(line.split()[1]) for line in self.printed if line.startswith("start ")]
        return start

    def stderr(self):
        return "".join(self._stderr)[-3000:]

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(30)


def run_trainer(checkpoint_dir, last_step, save_steps, out, timeout=90):
    trainer = Trainer(checkpoint_dir, last_step, save_steps, out)
    try:
        rc = trainer.finish(timeout)
        assert rc == 0, trainer.stderr()
        return trainer
    finally:
        trainer.kill()


def params_of(npz):
    with np.load(npz) as data:
        return {key: data[key] for key in data.files}


# -- 1, 2: kill and resume, SIGTERM (subprocesses) -------------------------------------------


def test_a_run_killed_with_sigkill_resumes_bit_for_bit(tmp_path):
    n, save_steps = 20, 5
    reference = tmp_path / "reference.npz"
    run_trainer(tmp_path / "uninterrupted", 2 * n, save_steps, reference)

    directory, out = tmp_path / "killed", tmp_path / "resumed.npz"
    trainer = Trainer(directory, 2 * n, save_steps, out, delay=0.03)
    try:
        killed_after = trainer.wait_for_step(12)
        trainer.proc.send_signal(signal.SIGKILL)
        assert trainer.proc.wait(30) == -signal.SIGKILL
    finally:
        trainer.kill()
    assert trainer.start_step() == 0 and not out.exists()
    complete = complete_steps(directory)
    latest = jm.latest_checkpoint_step(directory)
    assert latest == complete[-1] and 5 <= latest < 2 * n and latest % save_steps == 0
    assert killed_after >= 12

    resumed = run_trainer(directory, 2 * n, save_steps, out)  # the lock died with the killed process
    assert resumed.start_step() == latest  # resumed from the latest complete checkpoint
    assert resumed.steps_printed() == list(range(latest + 1, 2 * n + 1))
    got, want = params_of(out), params_of(reference)
    assert int(got.pop("step")) == int(want.pop("step")) == 2 * n
    assert sorted(got) == sorted(want) == ["w1", "w2"]
    for key in want:
        assert np.array_equal(got[key], want[key]), key
    assert jm.latest_checkpoint_step(directory) == 2 * n
    final = jm.restore_checkpoint(directory)
    assert final.step == final.meta["step"] == 2 * n
    assert np.array_equal(np.asarray(final.state["params"]["w1"]), want["w1"])


def test_sigterm_saves_the_step_it_reached_and_exits_cleanly(tmp_path):
    directory, out = tmp_path / "run", tmp_path / "out.npz"
    trainer = Trainer(directory, 10_000, 100_000, out, delay=0.04)
    try:
        trainer.wait_for_step(5)
        # The checkpoint at creation is the only one so far.
        assert set(complete_steps(directory)) <= {0}
        trainer.proc.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        last_printed = trainer.steps_printed()[-1]  # the signal came after this was printed
        rc = trainer.finish(timeout=30)
        took = time.monotonic() - signalled
    finally:
        trainer.kill()
    assert rc == 0, trainer.stderr()
    assert took < 30  # well within stop_grace_period_secs=30
    steps = trainer.steps_printed()
    assert steps == list(range(1, steps[-1] + 1)) and steps[-1] < 10_000
    latest = jm.latest_checkpoint_step(directory)
    assert latest is not None and latest >= last_printed
    assert latest == steps[-1]  # the step it stopped at was saved
    assert complete_steps(directory) == [0, latest]
    saved = params_of(out)
    assert int(saved["step"]) == latest
    restored = jm.restore_checkpoint(directory)
    assert restored.step == latest
    assert np.array_equal(np.asarray(restored.state["params"]["w2"]), saved["w2"])


# -- in-process helpers ------------------------------------------------------------------------


def init_fn():
    return {"w": jnp.arange(6, dtype=jnp.float32).reshape(2, 3), "b": jnp.zeros(3, jnp.float32)}


def add_one(state, batch):
    state = jax.tree.map(lambda x: x + 1, state)
    return state, {"total": state["b"].sum()}


def train(directory, last_step, save_steps=2, init=init_fn, step_fn=add_one, **kwargs):
    hooks = [jm.CheckpointSaverHook(directory, save_steps=save_steps), jm.StopAtStepHook(last_step=last_step)]
    with jm.MonitoredSession(step_fn, init, hooks=hooks, **kwargs) as sess:
        while not sess.should_stop():
            sess.run()
    return sess


class CountingInit:
    """An init_fn counting its concrete calls apart from traces (`jax.eval_shape`)."""

    def __init__(self, make=init_fn):
        self.make, self.concrete, self.traced = make, 0, 0

    def __call__(self):
        probe = jnp.zeros(())
        if isinstance(probe, jax.core.Tracer):
            self.traced += 1
        else:
            self.concrete += 1
        return self.make()


def state_files(directory, step):
    """The data files of a checkpoint's `state` item (OCDBT's "d" directories)."""
    found = []
    for root, _, files in os.walk(os.path.join(directory, str(step), "state")):
        if os.path.basename(root) == "d":
            found += [os.path.join(root, name) for name in files]
    assert found
    return found


def break_checkpoint(directory, step):
    """Cuts the step's state files short in a run that seals none: what Orbax itself fails
    to read (tests/checkpoints/test_integrity.py has the refusal by the manifest)."""
    for path in state_files(directory, step):
        with open(path, "r+b") as f:
            f.truncate(5)
    unseal(directory)


def unseal(directory):
    """The run as one written before integrity checks left it: no manifest in any checkpoint
    (one left would seal the run), and no record that the run seals its checkpoints."""
    for step in complete_steps(directory):
        if os.path.exists(os.path.join(directory, str(step), _integrity.MANIFEST)):
            os.remove(os.path.join(directory, str(step), _integrity.MANIFEST))
    if os.path.exists(os.path.join(directory, _integrity.SEALED_RUN)):
        os.remove(os.path.join(directory, _integrity.SEALED_RUN))


def assert_state(state, plus):
    base = init_fn()
    np.testing.assert_array_equal(np.asarray(state["w"]), np.asarray(base["w"]) + plus)
    np.testing.assert_array_equal(np.asarray(state["b"]), np.asarray(base["b"]) + plus)


# -- 3, 4: unfinished and broken checkpoints ----------------------------------------------------


def test_a_checkpoint_cut_off_mid_write_is_never_loaded_and_the_next_writer_removes_it(tmp_path, caplog):
    directory = tmp_path / "run"
    train(directory, 4)
    assert complete_steps(directory) == [0, 2, 4]
    # Orbax writes a step into "<step>.orbax-checkpoint-tmp" (orbax/checkpoint/_src/path/
    # atomicity.py: _get_tmp_directory) and renames it when done; older versions added
    # "-<timestamp>". Leave one of each, with higher steps and garbage inside.
    for name in ("9.orbax-checkpoint-tmp", "6.orbax-checkpoint-tmp-1712345678"):
        os.makedirs(directory / name / "state")
        (directory / name / "_CHECKPOINT_METADATA").write_text("{not json")
        (directory / name / "state" / "manifest.ocdbt").write_bytes(b"\0garbage")
    assert jm.latest_checkpoint_step(directory) == 4

    with jm.MonitoredSession(add_one, init_fn, checkpoint_dir=directory) as sess:
        assert sess.step == 4
        assert_state(sess.state, 4)
    assert jm.restore_checkpoint(directory).step == 4

    assert (directory / "9.orbax-checkpoint-tmp").is_dir()  # a reader leaves them: a writer may be saving

    # The next writer holds the directory: the saves left there are a dead run's, and go; then training on
    # through those step numbers saves real checkpoints there.
    with caplog.at_level(logging.WARNING, logger="jaxmon"):
        sess = train(directory, 8)
    assert sess.step == 8 and jm.latest_checkpoint_step(directory) == 8
    assert not list(directory.glob("*.orbax-checkpoint-tmp*"))
    removed = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Removed ")]
    assert removed == ["Removed 2 unfinished saves of a run that ended during them (6.orbax-checkpoint-tmp-1712345678, "
                       "9.orbax-checkpoint-tmp: 0.0 MB)."]
    restored = jm.restore_checkpoint(directory, like=init_fn())
    assert restored.step == 8
    assert_state(restored.state, 8)
    assert_state(jm.restore_checkpoint(directory, step=6, like=init_fn()).state, 6)


BIG_SAVER = textwrap.dedent("""
    import sys
    import jax.numpy as jnp
    import jaxmon as jm

    def step_fn(state, batch):  # 256 MB of state: a save long enough to be cut off
        return {"w": state["w"] + 1.0}, {}

    with jm.MonitoredSession(step_fn, lambda: {"w": jnp.zeros((64, 2**20))},
                             hooks=[jm.CheckpointSaverHook(sys.argv[1], save_steps=1)]) as sess:
        while not sess.should_stop():
            sess.run({})
""")


def test_a_save_killed_midway_leaves_a_temporary_directory_that_the_next_start_removes(tmp_path, caplog):
    script, directory = tmp_path / "saver.py", tmp_path / "run"
    script.write_text(BIG_SAVER)
    process = warm_processes.popen([sys.executable, str(script), str(directory)], env=CHILD_ENV,
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while not [p for p in directory.glob("*.orbax-checkpoint-tmp*") if p.is_dir() and any(p.rglob("*"))]:
            assert process.poll() is None and time.monotonic() < deadline
            time.sleep(0.005)
        process.send_signal(signal.SIGKILL)  # a save under way: its files in Orbax's temporary directory
        process.wait(timeout=60)
    finally:
        process.kill()
    (leftover,) = [p.name for p in directory.glob("*.orbax-checkpoint-tmp*")]
    writer = jm.CheckpointSaverHook(directory, save_steps=1)  # the next writer to take the directory
    with caplog.at_level(logging.WARNING, logger="jaxmon"):
        writer.begin()
    writer.close()
    assert not list(directory.glob("*.orbax-checkpoint-tmp*"))
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Removed ")]
    assert re.fullmatch(rf"Removed 1 unfinished save of a run that ended during it \({re.escape(leftover)}: "
                        r"[\d.]+ MB\)\.", line), line


def test_a_broken_latest_checkpoint_is_reported_and_the_one_before_is_used(tmp_path, caplog):
    directory = tmp_path / "run"
    train(directory, 4)
    break_checkpoint(directory, 4)
    init = CountingInit()
    with caplog.at_level(logging.WARNING, logger="jaxmon"):
        sess = jm.MonitoredSession(add_one, init, checkpoint_dir=directory)
    errors = [r.getMessage() for r in caplog.records if r.name == "jaxmon" and r.levelno == logging.ERROR]
    assert len(errors) == 1 and f"{directory}/4" in errors[0] and "does not restore" in errors[0]
    assert sess.step == 2
    assert_state(sess.state, 2)
    assert init.concrete == 0
    sess.run()
    assert_state(sess.state, 3)
    sess.close()
    assert jm.restore_checkpoint(directory).step == 2  # the reader skips it too


def test_training_on_from_the_checkpoint_before_a_broken_one_saves_over_the_broken_step(tmp_path, caplog):
    # The broken step directory is still there when the resumed run reaches its step
    # number; the save must not fail with Orbax's StepAlreadyExistsError.
    directory = tmp_path / "run"
    train(directory, 4)
    break_checkpoint(directory, 4)
    with caplog.at_level(logging.CRITICAL, logger="jaxmon"):
        sess = train(directory, 6)
    assert sess.step == 6 and complete_steps(directory) == [0, 2, 4, 6]
    restored = jm.restore_checkpoint(directory, step=4, like=init_fn())
    assert_state(restored.state, 4)
    assert jm.restore_checkpoint(directory).step == 6


def test_when_every_checkpoint_is_broken_creation_raises_and_never_starts_fresh(tmp_path, caplog):
    directory = tmp_path / "run"
    train(directory, 2)
    for step in (0, 2):
        break_checkpoint(directory, step)
    init = CountingInit()
    hook = RecordingHook()
    saver = jm.CheckpointSaverHook(directory, save_steps=1)
    with caplog.at_level(logging.ERROR, logger="jaxmon"), pytest.raises(RuntimeError, match="No checkpoint in"):
        jm.MonitoredSession(add_one, init, hooks=[saver, hook])
    errors = [r.getMessage() for r in caplog.records if r.name == "jaxmon" and r.levelno == logging.ERROR]
    assert len(errors) == 2 and f"{directory}/2 does not" in errors[0] and f"{directory}/0 does not" in errors[1]
    assert init.concrete == 0  # the fresh state was never made
    assert "after_create_session" not in hook.calls
    assert complete_steps(directory) == [0, 2]  # nothing saved over them
    with pytest.raises(RuntimeError, match="No checkpoint in"):
        jm.restore_checkpoint(directory)
    writer = jm.CheckpointSaverHook(directory, save_steps=1)
    writer.begin()  # the failed session released its writer lock
    writer.close()


# -- 5: restore or init, warm start -------------------------------------------------------


def test_with_checkpoints_init_fn_is_never_called_for_data(tmp_path):
    directory = tmp_path / "run"
    train(directory, 3, save_steps=3)
    init = CountingInit()
    called = []
    with jm.MonitoredSession(add_one, init, checkpoint_dir=directory,
                             warm_start=lambda s: called.append(1) or s) as sess:
        assert sess.step == 3
        assert_state(sess.state, 3)
    assert init.concrete == 0 and init.traced <= 1  # traced once at most, for the restore target
    assert called == [] and sess.warm_start_report is None


def test_without_checkpoints_init_fn_is_called_and_warm_start_applies(tmp_path):
    init = CountingInit()
    seen = []

    def warm(state):
        seen.append(jax.tree.map(np.asarray, state))
        return {**state, "b": state["b"] + 100}

    with jm.MonitoredSession(add_one, init, checkpoint_dir=tmp_path / "empty", warm_start=warm) as sess:
        assert sess.step == 0 and init.concrete == 1
        assert len(seen) == 1
        np.testing.assert_array_equal(seen[0]["w"], np.asarray(init_fn()["w"]))  # applied to the fresh state
        np.testing.assert_array_equal(np.asarray(sess.state["b"]), np.full(3, 100.0))
        assert sess.warm_start_report is None


def make_other():
    return {"w": jnp.full((2, 3), -1.0), "b": jnp.full((5,), -1.0), "new": jnp.full((2,), -1.0)}


def test_warm_start_from_another_runs_checkpoint_dir(tmp_path):
    source = tmp_path / "source"
    train(source, 4)
    with jm.MonitoredSession(add_one, make_other, warm_start=source) as sess:
        np.testing.assert_array_equal(np.asarray(sess.state["w"]), np.asarray(init_fn()["w"]) + 4)
        np.testing.assert_array_equal(np.asarray(sess.state["b"]), np.full(5, -1.0))
        np.testing.assert_array_equal(np.asarray(sess.state["new"]), np.full(2, -1.0))
        assert sess.step == 0
    report = sess.warm_start_report
    assert isinstance(report, jm.WarmStartReport)
    assert report.source == os.fspath(source)
    assert report.restored == ["w"]
    assert report.fresh == ["new"]
    assert len(report.mismatched) == 1 and report.mismatched[0].startswith("b ")
    assert "[3]" in report.mismatched[0] and "[5]" in report.mismatched[0]
    assert report.unused == []


def test_warm_start_from_one_step_directory(tmp_path):
    source = tmp_path / "source"
    train(source, 4)
    with jm.MonitoredSession(add_one, init_fn, warm_start=source / "2") as sess:
        assert_state(sess.state, 2)
        assert sess.step == 0
    assert sorted(sess.warm_start_report.restored) == ["b", "w"]
    assert sess.warm_start_report.fresh == sess.warm_start_report.mismatched == []
    only_w = jm.MonitoredSession(add_one, lambda: {"w": jnp.zeros((2, 3))}, warm_start=source / "2")
    assert only_w.warm_start_report.restored == ["w"] and only_w.warm_start_report.unused == ["b"]
    assert_state({"w": only_w.state["w"], "b": init_fn()["b"] + 2}, 2)
    only_w.close()


def test_warm_start_of_a_train_state_with_another_optimizer_takes_the_params(tmp_path):
    import optax

    def make(tx):
        return lambda: jm.TrainState.create(apply_fn=None, params={"w": jnp.ones((3, 1)), "b": jnp.zeros((1,))},
                                            tx=tx, rng=0)

    def step_fn(state, batch):
        return state.apply_gradients(grads=jax.tree.map(jnp.ones_like, state.params)), {}

    source = tmp_path / "source"
    trained = train(source, 2, init=make(optax.adam(0.1)), step_fn=step_fn)
    with jm.MonitoredSession(step_fn, make(optax.sgd(0.1)), warm_start=source) as sess:
        assert isinstance(sess.state, jm.TrainState)
        for key in ("w", "b"):
            assert np.array_equal(np.asarray(sess.state.params[key]), np.asarray(trained.state.params[key]))
        assert int(sess.state.step) == 0  # the optimizer's step count starts fresh, as in TF
    report = sess.warm_start_report
    assert sorted(report.restored) == ["params/b", "params/w"]
    assert sorted(report.skipped) == ["rng", "step"]  # training bookkeeping is never warm-started
    assert report.fresh == report.mismatched == []
    assert report.unused and all(name.startswith("opt_state/") for name in report.unused)  # Adam's moments
    with pytest.raises(FileNotFoundError):
        jm.MonitoredSession(step_fn, make(optax.sgd(0.1)), warm_start=tmp_path / "nothing-there")


def test_warm_start_is_not_applied_once_the_run_has_its_own_checkpoint(tmp_path):
    source, directory = tmp_path / "source", tmp_path / "run"
    train(source, 4)
    first = train(directory, 1, save_steps=1, init=make_other, warm_start=source)
    assert first.warm_start_report.restored == ["w"]
    # The warm-started values were trained on and saved; a restart restores them.
    with jm.MonitoredSession(add_one, make_other, checkpoint_dir=directory, warm_start=source) as sess:
        assert sess.step == 1 and sess.warm_start_report is None
        np.testing.assert_array_equal(np.asarray(sess.state["w"]), np.asarray(init_fn()["w"]) + 5)
        np.testing.assert_array_equal(np.asarray(sess.state["new"]), np.zeros(2))


# -- 6: shardings ---------------------------------------------------------------------------


def test_restored_arrays_have_the_targets_sharding(tmp_path):
    directory = tmp_path / "run"
    train(directory, 2)
    device = jax.devices()[-1]
    state = jax.device_put(init_fn(), device)
    with jm.MonitoredSession(add_one, state=state, checkpoint_dir=directory, donate_state=False) as sess:
        assert sess.step == 2
        for leaf in jax.tree.leaves(sess.state):
            assert leaf.sharding == jax.sharding.SingleDeviceSharding(device)
    restored = jm.restore_checkpoint(directory, like=init_fn())
    for leaf, target in zip(jax.tree.leaves(restored.state), jax.tree.leaves(init_fn()), strict=True):
        assert isinstance(leaf, jax.Array) and leaf.sharding == target.sharding


SHARDING_SCRIPT = textwrap.dedent("""
    import json, os, sys
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    import jaxmon as jm

    mesh = Mesh(np.array(jax.devices()), ("x",))
    split, replicated = NamedSharding(mesh, P("x")), NamedSharding(mesh, P())
    root = sys.argv[1]

    built = []  # one entry each time put_init runs for real (not traced by jax.eval_shape)

    def put_init():
        w = jax.device_put(jnp.arange(16.0), split)
        if not isinstance(w, jax.core.Tracer):
            built.append(1)
        return {"w": w, "b": jnp.zeros(3)}

    jit_init = jax.jit(lambda: {"w": jnp.arange(16.0), "b": jnp.zeros(3)},
                       out_shardings={"w": split, "b": replicated})

    def step_fn(state, batch):
        return jax.tree.map(lambda x: x + 1, state), {}

    def save(directory, init):
        hooks = [jm.CheckpointSaverHook(directory, save_steps=1), jm.StopAtStepHook(last_step=2)]
        with jm.MonitoredSession(step_fn, init, hooks=hooks) as sess:
            while not sess.should_stop():
                sess.run()

    def check(sess, want):
        w = sess.state["w"]
        ok = sess.step == 2 and np.array_equal(np.asarray(w), np.arange(16.0) + 2)
        return {"ok": bool(ok and w.sharding == want), "got": repr(w.sharding), "want": repr(want)}

    results = {"devices": len(jax.devices())}
    for name, init in (("device_put_init", put_init), ("jitted_init", jit_init)):
        directory = os.path.join(root, name)
        save(directory, init)
        before = len(built)
        with jm.MonitoredSession(step_fn, init, checkpoint_dir=directory) as sess:
            results[name] = check(sess, split)
        results[name]["put_init_runs"] = len(built) - before
    target = {"w": jax.device_put(jnp.zeros(16), replicated), "b": jnp.zeros(3)}
    with jm.MonitoredSession(step_fn, state=target, checkpoint_dir=os.path.join(root, "jitted_init")) as sess:
        results["given_state"] = check(sess, replicated)
    print("RESULTS " + json.dumps(results))
""")


@pytest.fixture(scope="module")
def sharding_results(tmp_path_factory):
    root = tmp_path_factory.mktemp("sharded")
    proc = subprocess.run([sys.executable, "-c", SHARDING_SCRIPT, str(root)], cwd=ROOT, env=cpu_env(devices=8),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    [line] = [line for line in proc.stdout.splitlines() if line.startswith("RESULTS ")]
    results = json.loads(line[len("RESULTS "):])
    assert results["devices"] == 8
    return results


def test_a_sharded_state_from_a_jitted_init_fn_is_restored_with_its_named_sharding(sharding_results):
    assert sharding_results["jitted_init"]["ok"], sharding_results["jitted_init"]


def test_a_state_given_directly_is_restored_into_its_own_named_sharding(sharding_results):
    assert sharding_results["given_state"]["ok"], sharding_results["given_state"]


def test_a_sharded_state_from_device_put_in_init_fn_is_restored_with_its_named_sharding(sharding_results):
    # jax.eval_shape(init_fn) loses the shardings that init_fn sets with jax.device_put; with
    # several devices the session then builds its restore target by running init_fn for real, once.
    result = sharding_results["device_put_init"]
    assert result["ok"] and result["put_init_runs"] == 1, result


# -- 7: exact resume of the data position ------------------------------------------------------


def regression_arrays():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(20, 3)).astype(np.float32)
    return {"x": x, "y": (x @ np.array([1.0, -2.0, 0.5], np.float32))[:, None]}


def sgd_init():
    return {"w": jnp.zeros((3, 1), jnp.float32), "b": jnp.zeros((1, 1), jnp.float32)}


def sgd_step(state, batch):
    def loss_fn(params):
        return jnp.mean((batch["x"] @ params["w"] + params["b"] - batch["y"]) ** 2)

    loss, grads = jax.value_and_grad(loss_fn)(state)
    return jax.tree.map(lambda p, g: p - 0.1 * g, state, grads), {"loss": loss}


class BatchRecorder(jm.Hook):
    """Records (step before the run, the batch's x) for every run."""

    def __init__(self):
        self.batches = []

    def before_run(self, ctx):
        self.batches.append((ctx.step, np.asarray(ctx.original_args.feeds["x"])))


def sgd_session(directory, last_step, *extra_hooks, save_steps=3):
    recorder = BatchRecorder()
    hooks = [jm.CheckpointSaverHook(directory, save_steps=save_steps), recorder,
             jm.StopAtStepHook(last_step=last_step), *extra_hooks]
    data = jm.ArrayDataSource(regression_arrays(), batch_size=4, seed=5)  # 5 batches per epoch
    with jm.MonitoredSession(sgd_step, sgd_init, data=data, hooks=hooks) as sess:
        while not sess.should_stop():
            sess.run()
    return sess, recorder.batches


def test_an_in_process_resume_continues_params_and_data_bit_for_bit(tmp_path):
    full, full_batches = sgd_session(tmp_path / "full", 12)
    first, first_batches = sgd_session(tmp_path / "split", 6)
    assert first.step == 6
    meta = jm.restore_checkpoint(tmp_path / "split").meta
    assert meta["step"] == 6 and meta["data"] == {"epoch": 1, "index": 1, "seed": 5}
    second, second_batches = sgd_session(tmp_path / "split", 12)
    assert second.step == 12
    for key in ("w", "b"):
        assert np.array_equal(np.asarray(second.state[key]), np.asarray(full.state[key])), key
    assert [step for step, _ in second_batches] == list(range(6, 12))
    assert np.array_equal(second_batches[0][1], full_batches[6][1])  # the 7th batch
    for (_, got), (_, want) in zip(first_batches + second_batches, full_batches, strict=True):
        assert np.array_equal(got, want)


def test_array_data_source_epochs_and_reshuffling():
    arrays = {"x": np.arange(10), "y": np.arange(10) * 10}
    source = jm.ArrayDataSource(arrays, batch_size=4, seed=2)
    assert len(source) == 2  # the remainder of 2 rows is dropped
    epochs = [np.concatenate([next(source)["x"] for _ in range(2)]) for _ in range(3)]
    for rows in epochs:
        assert len(set(rows.tolist())) == 8  # no row twice within an epoch
    assert not np.array_equal(epochs[0], epochs[1]) or not np.array_equal(epochs[1], epochs[2])
    assert source.get_state() == {"epoch": 2, "index": 2, "seed": 2}
    batch = next(source)
    assert np.array_equal(batch["y"], batch["x"] * 10)  # the same rows of every array
    assert source.get_state() == {"epoch": 3, "index": 1, "seed": 2}
    plain = jm.ArrayDataSource(arrays, batch_size=4, shuffle=False, drop_remainder=False)
    assert len(plain) == 3
    assert [next(plain)["x"].tolist() for _ in range(3)] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]


def test_array_data_source_set_state_resumes_exactly():
    arrays = {"x": np.arange(12)}
    source = jm.ArrayDataSource(arrays, batch_size=5, seed=9)
    for _ in range(3):
        next(source)
    state = source.get_state()
    assert state == {"epoch": 1, "index": 1, "seed": 9}
    rest = [next(source)["x"] for _ in range(5)]
    other = jm.ArrayDataSource(arrays, batch_size=5, seed=9)
    other.set_state(json.loads(json.dumps(state)))  # through JSON, as in a checkpoint
    assert all(np.array_equal(next(other)["x"], want) for want in rest)
    with pytest.raises(ValueError, match="seed"):
        jm.ArrayDataSource(arrays, batch_size=5, seed=10).set_state(state)


def test_array_data_source_num_epochs_ends_with_stop_iteration():
    source = jm.ArrayDataSource({"x": np.arange(6)}, batch_size=3, num_epochs=2)
    batches = list(source)
    assert len(batches) == 4
    for epoch in (batches[:2], batches[2:]):
        assert sorted(np.concatenate([batch["x"] for batch in epoch]).tolist()) == list(range(6))
    with pytest.raises(StopIteration):
        next(source)
    resumed = jm.ArrayDataSource({"x": np.arange(6)}, batch_size=3, num_epochs=2)
    resumed.set_state({"epoch": 1, "index": 1, "seed": 0})
    assert np.array_equal(next(resumed)["x"], batches[3]["x"])
    with pytest.raises(StopIteration):
        next(resumed)


def test_a_resumed_session_ends_cleanly_at_the_end_of_its_data(tmp_path):
    directory = tmp_path / "run"

    def session(last_step):
        data = jm.ArrayDataSource({"x": np.arange(8.0)}, batch_size=2, num_epochs=2)  # 8 batches
        hooks = [jm.CheckpointSaverHook(directory, save_steps=100), jm.StopAtStepHook(last_step=last_step)]
        return jm.MonitoredSession(lambda s, b: (s + b["x"].sum(), {}), lambda: jnp.zeros(()), data=data,
                                   hooks=hooks)

    with session(5) as sess:
        while not sess.should_stop():
            sess.run()
    assert sess.step == 5
    with session(100) as sess:
        assert sess.step == 5
        while not sess.should_stop():
            sess.run()
    assert sess.step == 8 and float(sess.state) == 2 * 28.0
    assert jm.restore_checkpoint(directory).step == 8


# -- 8: recovery from checkpoints -----------------------------------------------------------


@pytest.mark.parametrize("save_steps", [1, 2])
def test_recovery_restores_the_latest_checkpoint_state_and_step_together(tmp_path, save_steps):
    saver = jm.CheckpointSaverHook(tmp_path / "run", save_steps=save_steps)
    hook = RecordingHook(raise_in={"before_run": (4, jm.AbortedError("preempted"))})
    sess = jm.MonitoredSession(count_step, zero, hooks=[saver, hook])
    assert [int(sess.run(fetches="value")) for _ in range(3)] == [1, 2, 3]
    restored_step = 3 if save_steps == 1 else 2
    value = int(sess.run(fetches="value"))  # aborts, restores, retries
    assert sess.step == value == restored_step + 1  # the state and the step restored together
    assert int(sess.run(fetches="value")) == sess.step == restored_step + 2
    assert not sess.should_stop()
    assert hook.calls["begin"] == 1 and hook.calls["after_create_session"] == 2
    assert hook.sessions == [sess, sess]
    assert [ctx.step for ctx in hook.contexts] == [0, 1, 2, 3, restored_step, restored_step + 1]
    sess.close()
    assert jm.restore_checkpoint(tmp_path / "run").step == restored_step + 2


def test_recovery_with_a_data_source_replays_exactly_what_an_uninterrupted_run_sees(tmp_path):
    # The recovery rewinds `data` to the checkpoint's position; the batch taken for the
    # aborted attempt is past it, so the retry takes its batch afresh from there.
    full, full_batches = sgd_session(tmp_path / "full", 6, save_steps=1)
    aborting = RecordingHook(raise_in={"before_run": (4, jm.AbortedError("preempted"))})
    recovered, batches = sgd_session(tmp_path / "recovered", 6, aborting, save_steps=1)
    assert aborting.calls["after_create_session"] == 2
    assert recovered.step == 6
    steps = [step for step, _ in batches]
    assert steps == [0, 1, 2, 3, 3, 4, 5]  # step 3's first attempt aborted
    del batches[3]
    for (step, got), (_, want) in zip(batches, full_batches, strict=True):
        assert np.array_equal(got, want), f"step {step} got another batch"
    for key in ("w", "b"):
        assert np.array_equal(np.asarray(recovered.state[key]), np.asarray(full.state[key])), key


# -- 9: plain Orbax ---------------------------------------------------------------------


def test_plain_orbax_restores_a_jaxmon_checkpoint(tmp_path):
    checkpoint_dir = tmp_path / "run"
    sess = train(checkpoint_dir, 3, save_steps=2)  # saves 0, 2, and 3 at the end
    final_state = jax.tree.map(np.asarray, sess.state)
    abstract_state = jax.eval_shape(init_fn)

    import orbax.checkpoint as ocp
    manager = ocp.CheckpointManager(checkpoint_dir)
    step = manager.latest_step()
    restored = manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract_state),   # e.g. jax.eval_shape(init_fn)
        meta=ocp.args.JsonRestore()))
    state, meta = restored["state"], restored["meta"]      # meta["step"] == step

    manager.close()
    assert step == 3 and meta["step"] == step
    assert sorted(state) == ["b", "w"]
    for key in ("w", "b"):
        assert np.array_equal(np.asarray(state[key]), final_state[key]), key
        assert state[key].dtype == final_state[key].dtype
    assert meta["format"] == "jaxmon-checkpoint/1"


# -- 10: checkpoints_iterator --------------------------------------------------------------


def test_checkpoints_iterator_follows_a_writer_and_ends_after_the_timeout(tmp_path):
    directory = tmp_path / "run"
    train(directory, 2)  # 0 and 2 are there before the iterator starts

    class Slow(jm.Hook):
        def after_run(self, ctx, values):
            time.sleep(0.4)

    errors = []

    def writer():
        try:
            hooks = [jm.CheckpointSaverHook(directory, save_steps=1), jm.StopAtStepHook(last_step=5), Slow()]
            with jm.MonitoredSession(add_one, init_fn, hooks=hooks) as sess:
                while not sess.should_stop():
                    sess.run()
        except BaseException as error:  # reported below
            errors.append(error)

    thread = threading.Thread(target=writer, daemon=True)
    yielded, restored, times = [], [], []
    timeout = 1.0
    try:
        # timeout_fn: keep waiting while the writer runs (its start takes a while).
        for path in jm.checkpoints_iterator(directory, timeout=timeout, poll_secs=0.02,
                                            timeout_fn=lambda: thread.ident is not None and not thread.is_alive()):
            times.append(time.monotonic())
            yielded.append(path)
            result = jm.restore_checkpoint(path, like=init_fn())
            restored.append(result.step)
            assert_state(result.state, result.step)
            assert result.meta["step"] == result.step
            if len(yielded) == 1:
                thread.start()
        ended = time.monotonic()
    finally:
        if thread.ident is not None:
            thread.join(60)
    assert not errors, errors
    assert not thread.is_alive()
    steps = [int(os.path.basename(path)) for path in yielded]
    assert all(os.path.dirname(path) == os.fspath(directory) for path in yielded)
    assert steps == restored
    assert steps[0] == 2  # the latest already there comes first
    assert steps[-1] == 5 and steps == sorted(set(steps)) and set(steps) <= {2, 3, 4, 5}
    assert len(steps) >= 3  # it followed the writer, not only its last save
    assert ended - times[-1] >= timeout  # ended once nothing new came for `timeout`


def test_checkpoints_iterator_yields_the_latest_then_ends_after_the_timeout(tmp_path):
    directory = tmp_path / "run"
    train(directory, 2)
    start = time.monotonic()
    assert list(jm.checkpoints_iterator(directory, timeout=0.3, poll_secs=0.02)) == [os.path.join(directory, "2")]
    assert time.monotonic() - start >= 0.3


def test_checkpoints_iterator_on_an_empty_directory_yields_nothing(tmp_path):
    start = time.monotonic()
    assert list(jm.checkpoints_iterator(tmp_path / "missing", timeout=0.2, poll_secs=0.02)) == []
    assert time.monotonic() - start >= 0.2
    with pytest.raises(FileNotFoundError, match="No checkpoint in"):
        jm.restore_checkpoint(tmp_path / "missing")


def test_warm_start_of_a_train_state_takes_every_part_but_the_training_bookkeeping(tmp_path):
    import optax

    def make():
        return jm.TrainState.create(apply_fn=None, params={"w": jnp.ones((2,))}, tx=optax.adam(0.1), rng=0,
                                    extras={"ema": {"w": jnp.zeros((2,))}})

    def step_fn(state, batch):
        state = state.apply_gradients(grads={"w": jnp.ones((2,))})
        return state.replace(extras={"ema": {"w": state.extras["ema"]["w"] + 1}}), {}

    source = tmp_path / "source"
    trained = train(source, 2, init=make, step_fn=step_fn)
    with jm.MonitoredSession(step_fn, make, warm_start=source) as sess:
        np.testing.assert_array_equal(np.asarray(sess.state.extras["ema"]["w"]), [2.0, 2.0])  # an extra is taken
        np.testing.assert_array_equal(np.asarray(sess.state.params["w"]), np.asarray(trained.state.params["w"]))
        assert int(sess.state.step) == 0
    report = sess.warm_start_report
    assert sorted(report.restored) == ["extras/ema/w", "params/w"]
    assert "step" in report.skipped and all(name.split("/")[0] in ("opt_state", "step", "rng")
                                            for name in report.skipped)


def test_hook_states_saved_under_position_keys_are_still_restored(tmp_path):
    # Checkpoints written before hook states were keyed by class name keyed them "i:Class".
    directory = tmp_path / "run"
    train(directory, 4, save_steps=4)
    step_dir = directory / "4" / "meta" / "metadata"
    meta = json.loads(step_dir.read_text())
    meta["hooks"] = {"1:StopAtStepHook": {"last_step": 4}}
    step_dir.write_text(json.dumps(meta))
    unseal(directory)  # as written then: no manifest, restored unchecked
    stop = jm.StopAtStepHook(num_steps=100)  # would train on to 104 without its saved state
    with jm.MonitoredSession(add_one, init_fn, hooks=[jm.CheckpointSaverHook(directory, save_steps=4), stop]) as sess:
        assert sess.restored_step == 4
        while not sess.should_stop():
            sess.run()
    assert sess.step == 4
