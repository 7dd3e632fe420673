"""Ctrl-C, SIGTERM and SIGHUP at any moment of `jaxmon train`: from its first line on,
each ends in exit 130 / 143 / 129 and one last line (stopped before training started, nothing to save; or
the step it stopped at and the checkpoint saved there), never a traceback, never lost;
and the small messages: an infinite loss, the notice of a state with two leaves on one
buffer."""

import logging
import os
import pathlib
import re
import signal
import subprocess
import sys
import sysconfig
import time

import jax
import jax.numpy as jnp
import pytest
import warm_processes
from helpers import DEFAULT, ROOT, assert_fails, assert_same_checkpoint, run_jaxmon, tiny_config

import jaxmon as jm
from jaxmon._base import signals as _signals
from jaxmon._run.state_life import unaliased

EXIT = {signal.SIGINT: 130, signal.SIGTERM: 143, signal.SIGHUP: 129}
NAME = {signal.SIGINT: "Ctrl-C", signal.SIGTERM: "SIGTERM", signal.SIGHUP: "SIGHUP"}
SCRIPT = pathlib.Path(sysconfig.get_path("scripts")) / "jaxmon"  # the console script


def start(workdir, *args, command=(sys.executable, "-m", "jaxmon"), launch=subprocess.Popen):
    """`jaxmon train` of the default config in `workdir`, running: a fresh process, or one
    from `warm_processes.popen` for a test whose subject is not the process's start."""
    return launch([*command, "train", "--config", DEFAULT, "--workdir", str(workdir), *args], cwd=ROOT, text=True,
                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, "PYTHONUNBUFFERED": "1"})


def caught(pid, signum):
    """Whether process `pid` has a handler for `signum` (Linux: /proc/PID/status, SigCgt)."""
    with open(f"/proc/{pid}/status") as status:
        mask = next(line for line in status if line.startswith("SigCgt:")).split()[1]
    return bool(int(mask, 16) >> (signum - 1) & 1)


def wait_for_the_handlers(process, timeout=60):
    """Waits until `process` handles SIGTERM: `import jaxmon` has begun (before it, the
    interpreter itself starts: Python's own handling, nothing of jaxmon's yet)."""
    deadline = time.monotonic() + timeout
    while not caught(process.pid, signal.SIGTERM):
        assert time.monotonic() < deadline and process.poll() is None
        time.sleep(0.005)


def finish(process, timeout=240):
    """The `CompletedProcess` of `process`, once it ended (killed if it outlives `timeout`)."""
    try:
        out, err = process.communicate(timeout=timeout)
    finally:
        process.kill()
    return subprocess.CompletedProcess(process.args, process.returncode, out, err)


def assert_stopped(result, signum):
    """Exit 130 / 143 / 129, one last line `jaxmon train: Stopped by <signal> ...`, nothing
    swallowed (Python's "Exception ignored"); returns that line."""
    last = assert_fails(result, EXIT[signum], f"Stopped by {NAME[signum]}")
    assert "Exception ignored" not in result.stderr, result.stderr[-3000:]
    return last


# -- during start-up: nothing to save ----------------------------------------------------------


# From the imports (JAX: a second or more) to the session's creation, each signal early and late:
# both go through the same start-up handler, so each delay is tried with one of them.
@pytest.mark.parametrize(("delay", "signum"), [(0.2, signal.SIGINT), (0.5, signal.SIGTERM), (0.8, signal.SIGINT),
                                               (1.2, signal.SIGTERM), (2.0, signal.SIGINT)],
                         ids=["0.2-ctrl-c", "0.5-sigterm", "0.8-ctrl-c", "1.2-sigterm", "2.0-ctrl-c"])
def test_a_signal_during_start_up_exits_130_or_143_in_one_line(tmp_path, signum, delay):
    process = start(tmp_path / "run", "--config.steps=5000")  # still training when the signal comes
    wait_for_the_handlers(process)
    time.sleep(delay)  # the imports (JAX: a second or more), the config, the session's creation
    process.send_signal(signum)
    last = assert_stopped(finish(process), signum)
    if "before training started" in last:  # else the session had taken the signal over: it saved
        assert "nothing to save" in last
    else:
        assert re.search(r"at step \d+; checkpoint \d+ is saved", last), last


def test_the_console_script_handles_a_signal_during_its_imports(tmp_path):
    process = start(tmp_path / "run", command=(str(SCRIPT),))
    wait_for_the_handlers(process)
    time.sleep(0.3)
    process.send_signal(signal.SIGTERM)
    last = assert_stopped(finish(process), signal.SIGTERM)
    assert "before training started: nothing to save" in last


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_a_signal_while_the_config_file_runs_ends_the_command_at_once(tmp_path, signum):
    """The config file is the user's code, run before JAX loads (a config's error is said
    at once): a signal while it runs ends the command with the start-up line."""
    config = tmp_path / "slow.py"
    config.write_text(f"import pathlib, runpy, time\n\ndef get_config():\n"
                      f"    pathlib.Path({str(tmp_path / 'running')!r}).touch()\n"
                      f"    import jax, flax.linen, optax  # a signal lands in these imports, or after\n"
                      f"    time.sleep(30)\n    return runpy.run_path({DEFAULT!r})['get_config']()\n")
    process = subprocess.Popen([sys.executable, "-m", "jaxmon", "train", "--config", str(config), "--workdir",
                                str(tmp_path / "run")], cwd=ROOT, text=True, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE)
    deadline = time.monotonic() + 60
    while not (tmp_path / "running").exists():
        assert time.monotonic() < deadline and process.poll() is None
        time.sleep(0.01)
    process.send_signal(signum)
    last = assert_stopped(finish(process, timeout=20), signum)
    assert last == f"jaxmon train: Stopped by {NAME[signum]} before training started: nothing to save; run the " \
                   "same command to train."
    assert not (tmp_path / "run").exists()


# -- during the first compilation: the session saves, then stops ----------------------------------


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_a_signal_during_the_first_compilation_saves_the_step_it_stops_on(tmp_path, signum):
    workdir = tmp_path / "run"
    process = start(workdir, "--config.steps=100000", "--no_compilation_cache", launch=warm_processes.popen)
    deadline = time.monotonic() + 180
    while jm.latest_checkpoint_step(workdir) is None:  # the step-0 save ends while the step compiles
        assert time.monotonic() < deadline and process.poll() is None
        time.sleep(0.05)
    process.send_signal(signum)
    result = finish(process)
    last = assert_stopped(result, signum)
    stopped = re.search(rf"Stopped by {NAME[signum]} at step (\d+); checkpoint (\d+) is saved: run the same "
                        r"command to resume\.$", last)
    assert stopped and stopped[1] == stopped[2], last  # the prefix, the step, the checkpoint: Ctrl-C's shape
    assert jm.latest_checkpoint_step(workdir) == int(stopped[1])


# -- SIGHUP: a closed terminal saves and stops as SIGTERM does ----------------------------------


def test_sighup_mid_run_saves_says_so_in_one_line_exits_129_and_the_rerun_resumes_bit_exactly(tmp_path):
    config = tiny_config(tmp_path, steps=60, sleep=0.05)
    whole = run_jaxmon(["train", "--config", config, "--workdir", tmp_path / "whole"], cwd=ROOT, env=dict(os.environ),
                       timeout=300)
    assert whole.returncode == 0, whole.stderr[-3000:]
    workdir = tmp_path / "run"
    process = warm_processes.popen([sys.executable, "-m", "jaxmon", "train", "--config", str(config), "--workdir",
                                    str(workdir)], cwd=ROOT, text=True, stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE)
    deadline = time.monotonic() + 180
    while (jm.latest_checkpoint_step(workdir) or 0) < 20:  # mid-run: the first periodic checkpoint is complete
        assert time.monotonic() < deadline and process.poll() is None
        time.sleep(0.05)
    process.send_signal(signal.SIGHUP)
    last = assert_stopped(finish(process), signal.SIGHUP)
    stopped = re.fullmatch(r"jaxmon train: Stopped by SIGHUP at step (\d+); checkpoint (\d+) is saved: run the same "
                           r"command to resume\.", last)
    assert stopped and stopped[1] == stopped[2] and 20 <= int(stopped[1]) < 60, last
    assert jm.latest_checkpoint_step(workdir) == int(stopped[1])
    again = run_jaxmon(["train", "--config", config, "--workdir", workdir], cwd=ROOT, env=dict(os.environ),
                       timeout=300)
    assert again.returncode == 0 and f"Resumed from step {stopped[1]}" in again.stderr + again.stdout, again.stderr
    assert_same_checkpoint(workdir, tmp_path / "whole", 60)


# -- a signal Python swallows is raised again -----------------------------------------------------


class RaisesCtrlCWhenCollected:
    """Ctrl-C while Python collects it: an exception raised in `__del__` is swallowed."""

    def __del__(self):
        signal.raise_signal(signal.SIGINT)


def test_a_ctrl_c_swallowed_in_a_del_is_raised_again_in_the_main_thread():
    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGALRM), sys.unraisablehook
    with pytest.raises(KeyboardInterrupt), _signals.handling():
        RaisesCtrlCWhenCollected()  # collected at once: Ctrl-C inside `__del__`, swallowed there
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:  # raised again here, 50 ms later
            pass
    assert time.monotonic() < deadline
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGALRM), sys.unraisablehook) == before


def test_a_swallowed_ctrl_c_goes_to_the_handler_that_took_ctrl_c_over_since():
    taken = []
    with _signals.handling():
        RaisesCtrlCWhenCollected()
        signal.signal(signal.SIGINT, lambda signum, frame: taken.append(signum))  # a session's
        deadline = time.monotonic() + 5
        while not taken and time.monotonic() < deadline:
            time.sleep(0.01)
    assert taken == [signal.SIGINT]


def test_a_signal_a_library_caught_goes_to_the_session_that_takes_the_signals_over(caplog):
    """SIGTERM raised inside native code that catches what it calls (JAX's first lowering
    imports an extension module) is lost there: the session that takes SIGTERM over next
    acts on it (saves at the next step boundary and stops), and it is not raised again."""
    with _signals.handling():
        try:
            signal.raise_signal(signal.SIGTERM)
        except _signals.Terminated:
            pass  # what the library did with it
        with caplog.at_level(logging.WARNING, logger="jaxmon"):
            with jm.MonitoredSession(lambda state, batch: (state + 1, {}), state=jnp.zeros(())) as sess:
                stopped = sess.should_stop()
        _signals.check()  # nothing left to raise
    assert stopped
    assert [r.getMessage() for r in caplog.records] == [
        "SIGTERM or request_preemption(): saving at the next step boundary, then stopping; a second one stops at "
        "once."]


def test_importing_jaxmon_outside_the_command_leaves_the_signals_alone():
    handlers = {signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)}
    assert not handlers & {_signals._exit_at_once, _signals._raise}  # noqa: SLF001


# -- the small messages -------------------------------------------------------------------------


def test_an_infinite_loss_is_named_non_finite_not_nan():
    def step_fn(state, batch):
        state = state + 1
        return state, {"loss": jnp.where(state == 3, jnp.inf, 0.0)}

    with pytest.raises(jm.NanLossDuringTrainingError) as raised:
        with jm.MonitoredSession(step_fn, state=jnp.zeros(()), hooks=[jm.NanHook("loss", every_n_steps=1)]) as sess:
            for _ in range(6):
                sess.run()
    assert str(raised.value).startswith("Non-finite loss during training: 'loss' = inf at step 3.")


def test_leaves_on_one_buffer_are_copied_apart_only_for_a_step_that_takes_the_buffers(caplog):
    w = jnp.ones((3,))
    with caplog.at_level(logging.WARNING, logger="jaxmon"):
        kept = unaliased({"params": w, "avg": w}, donated=False)
        assert kept["avg"] is kept["params"] is w and not caplog.records  # reading one buffer twice is fine
        copied = unaliased({"params": w, "avg": w})
    assert copied["params"] is not copied["avg"]
    [notice] = [r.getMessage() for r in caplog.records]
    assert "donate_state=True" in notice and "donate_state=False" in notice and "jnp.copy" in notice
    assert jax.numpy.array_equal(copied["params"], copied["avg"])
