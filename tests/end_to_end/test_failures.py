"""Failures as a user meets them: `jaxmon train` ends each with one line that names what
failed and the value, the exit code `--help` documents (2: something given wrong, 1:
training failed, 130: Ctrl-C, after a save), and loses nothing already saved."""

import contextlib
import re
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import warm_processes
from helpers import (
    DEFAULT,
    ROOT,
    SAVES_ONLY,
    assert_fails,
    assert_same_checkpoint,
    signal_between_saves,
    tiny_config,
    tmpfs,
    train,
)

import jaxmon as jm
from jaxmon._checkpoints.manager import complete_steps

# -- given wrong: exit 2 ----------------------------------------------------------------------


@pytest.mark.parametrize("override, words", [
    ("--config.steps=-5", ["'steps' is the last step to train to, at least 1; got -5", "--config.steps=100"]),
    ("--config.data.batch_size=100000", ["batch_size=100000", "1438 rows"]),
    ("--config.optimizer.lr=0.01", ["'optimizer.lr'", "Did you mean 'optimizer.learning_rate'?"]),
    ("--config.sesion.max_to_keep=2", ["'sesion.max_to_keep'", "Did you mean 'session.max_to_keep'?"]),
])
def test_a_bad_value_or_key_exits_2_naming_it(tmp_path, override, words):
    assert_fails(train(tmp_path / "run", override), 2, *words)


@pytest.mark.parametrize("name, text, where, words", [
    ("exp.yaml", "seed: 0\nsteps: [\n", "line 3, column 1", "expected the node content"),
    ("exp.py", "def get_config(:\n    return {}\n", "line 1", "syntax"),
])
def test_a_config_syntax_error_exits_2_naming_the_file_and_line(tmp_path, name, text, where, words):
    config = tmp_path / name
    config.write_text(text)
    assert_fails(train(tmp_path / "run", config=config), 2, f"{config}, {where}", words)


def test_a_workdir_that_is_a_file_exits_2(tmp_path):
    workdir = tmp_path / "notes.txt"
    workdir.write_text("not a run")
    assert_fails(train(workdir), 2, f"{str(workdir)!r} is a file", "give --workdir a directory")


def test_a_workdir_that_cannot_be_written_exits_2(tmp_path):
    with tmpfs(tmp_path / "ro", "64k") as mount:
        subprocess.run(["mount", "-o", "remount,ro", str(mount)], check=True)
        assert_fails(train(mount / "run"), 2, f"{str(mount / 'run')!r}", "Read-only file system")


def test_a_workdir_in_use_by_another_run_exits_2_naming_that_run(tmp_path):
    workdir = tmp_path / "run"
    config = tiny_config(tmp_path, steps=1_000_000, sleep=0.5)  # a run that goes on, idle between its steps
    first = warm_processes.popen([sys.executable, "-m", "jaxmon", "train", "--config", str(config), "--workdir",
                                  str(workdir)], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while jm.latest_checkpoint_step(workdir) is None:  # the step-0 save: it holds the lock
            assert time.monotonic() < deadline and first.poll() is None
            time.sleep(0.2)
        assert_fails(train(workdir, config=config), 2, f"{workdir} is being written by pid {first.pid}",
                     "stop the other run")
    finally:
        first.kill()
        first.wait()


# -- training failures: exit 1 ------------------------------------------------------------------


def test_a_nan_loss_exits_1_naming_the_step_with_the_traceback_in_the_workdir(tmp_path):
    workdir = tmp_path / "run"
    last = assert_fails(train(workdir, "--config.optimizer.learning_rate=1e9"), 1,
                        "NaN loss during training: 'loss' = nan at step")
    assert "Lower the learning rate" in last
    assert "Traceback" in (workdir / "jaxmon-error.log").read_text()
    debug = train(tmp_path / "again", "--config.optimizer.learning_rate=1e9", "--debug")
    assert debug.returncode == 1 and "Traceback (most recent call last)" in debug.stderr  # --debug prints it


@pytest.mark.slow
def test_a_full_disk_fails_the_save_in_one_line_and_keeps_every_complete_checkpoint(tmp_path):
    reference = tmp_path / "reference"
    assert train(reference, "--config.steps=30", *SAVES_ONLY).returncode == 0
    with tmpfs(tmp_path / "disk", "1100k") as disk:  # room for two checkpoints of the CNN, not three
        workdir = disk / "run"
        last = assert_fails(train(workdir, "--config.steps=30", *SAVES_ONLY), 1, "No space left on device")
        failed = int(re.search(rf"Saving checkpoint (\d+) to {workdir} failed: \[Errno 28\] ", last)[1])
        complete = complete_steps(workdir)
        assert complete == list(range(0, failed, 10)) and failed >= 10
        assert f"the newest: {complete[-1]}" in last
        for step in complete:  # bit for bit what the uninterrupted run saved at that step
            assert_same_checkpoint(workdir, reference, step)
        subprocess.run(["mount", "-o", "remount,size=8m", str(disk)], check=True)  # space freed
        resumed = train(workdir, "--config.steps=30", *SAVES_ONLY)
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        assert f"Resumed from step {complete[-1]} in {workdir}" in resumed.stdout
        assert_same_checkpoint(workdir, reference, 30)


# -- Ctrl-C: save, then exit 130 ----------------------------------------------------------------


def test_ctrl_c_saves_the_step_it_stops_on_exits_130_and_the_same_command_resumes(tmp_path):
    workdir = tmp_path / "run"
    result = signal_between_saves(DEFAULT, workdir, signal.SIGINT, ROOT)  # the next save is 600 s away
    last = assert_fails(result, 130, "Stopped by Ctrl-C at step")
    step = int(re.search(r"at step (\d+); checkpoint (\d+) is saved", last)[1])
    assert step > 0 and jm.latest_checkpoint_step(workdir) == step
    resumed = train(workdir, "--config.steps", step + 10, "--config.hooks.1.every_n_steps=100000")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"Resumed from step {step} in {workdir}" in resumed.stdout


def test_keyboard_interrupt_inside_with_saves_then_propagates(tmp_path):
    def step_fn(state, batch):
        return state + 1, {"loss": state}

    saver = jm.CheckpointSaverHook(tmp_path, save_secs=600)
    with pytest.raises(KeyboardInterrupt), jm.MonitoredSession(step_fn, state=jnp.zeros(()), hooks=[saver]) as sess:
        for _ in range(7):
            sess.run({})
        raise KeyboardInterrupt
    assert saver.saved_steps == [0, 7] and jm.latest_checkpoint_step(tmp_path) == 7


def test_ctrl_c_in_a_session_saves_at_the_next_step_and_raises_keyboard_interrupt_once_closed(tmp_path):
    def step_fn(state, batch):
        return state + 1, {"loss": state}

    saver, before = jm.CheckpointSaverHook(tmp_path, save_secs=600), signal.getsignal(signal.SIGINT)
    with pytest.raises(KeyboardInterrupt, match="Stopped by Ctrl-C at step 5"):
        with jm.MonitoredSession(step_fn, state=jnp.zeros(()), hooks=[saver]) as sess:
            while not sess.should_stop():
                sess.run({})
                if sess.step == 5:
                    signal.raise_signal(signal.SIGINT)  # the handler only asks to stop
    assert saver.saved_steps == [0, 5] and signal.getsignal(signal.SIGINT) is before  # handed back


def test_a_session_used_without_with_leaves_ctrl_c_to_python():
    before = signal.getsignal(signal.SIGINT)
    sess = jm.MonitoredSession(lambda state, batch: (state + 1, {}), state=jnp.zeros(()))
    sess.run({})
    assert signal.getsignal(signal.SIGINT) is before  # a session left open never swallows a Ctrl-C
    with sess:
        assert signal.getsignal(signal.SIGINT) is not before
    assert signal.getsignal(signal.SIGINT) is before


class SecondCtrlC(jm.Hook):
    """A second Ctrl-C while the session closes, before the saver's final save."""

    def end(self, session):
        signal.raise_signal(signal.SIGINT)


def test_a_second_ctrl_c_while_closing_abandons_the_save_and_the_checkpoint_before_stands(tmp_path):
    def step_fn(state, batch):
        return state + 1, {"loss": state}

    saver = jm.CheckpointSaverHook(tmp_path, save_secs=600)
    # Python's own handler before the session (an unclosed session of another test may have left its own)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    with pytest.raises(KeyboardInterrupt) as raised, contextlib.ExitStack() as stack:
        stack.callback(signal.signal, signal.SIGINT, previous)
        with jm.MonitoredSession(step_fn, state=jnp.zeros(()), hooks=[SecondCtrlC(), saver]) as sess:
            while not sess.should_stop():
                sess.run({})
                if sess.step == 5:
                    signal.raise_signal(signal.SIGINT)
    assert not raised.value.args  # Python's own, from the second Ctrl-C: not the session's "Stopped by Ctrl-C"
    assert saver.saved_steps == [0] and complete_steps(tmp_path) == [0]


# -- a state with two leaves on one buffer ---------------------------------------------------------


def test_a_state_with_two_leaves_on_one_buffer_trains_after_a_one_line_notice(caplog):
    params = {"w": jnp.ones((3,)), "b": jnp.zeros(())}

    def step_fn(state, batch):  # TF's moving average of the weights, started from the weights themselves
        new = jax.tree.map(lambda p: p - 0.1, state["params"])
        avg = jax.tree.map(lambda a, p: 0.9 * a + 0.1 * p, state["avg"], new)
        return {"params": new, "avg": avg}, {"loss": jnp.sum(new["w"])}

    with caplog.at_level("WARNING", logger="jaxmon"):
        with jm.MonitoredSession(step_fn, state={"params": params, "avg": params}) as sess:
            for _ in range(3):
                sess.run({})
    np.testing.assert_allclose(np.asarray(sess.state["params"]["w"]), 0.7, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(sess.state["avg"]["w"]), 0.9439, rtol=1e-4)
    [notice] = [r.getMessage() for r in caplog.records if "share a buffer" in r.getMessage()]
    assert "state['params']['w'] (the buffer of state['avg']['w'])" in notice and "jnp.copy" in notice


def test_the_readme_exit_codes_are_those_of_help():
    readme = (ROOT / "README.md").read_text()
    table = dict(re.findall(r"^\| (\d+) \| (.+?) \|$", readme, flags=re.M))
    assert set(table) == {"0", "1", "2", "75", "76", "129", "130", "143"}, table
    help_text = subprocess.run([sys.executable, "-m", "jaxmon", "train", "--help"], capture_output=True, text=True,
                               timeout=60).stdout
    for code in table:
        assert re.search(rf"\b{code}\b", help_text), code
