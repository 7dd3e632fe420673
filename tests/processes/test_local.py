"""`jaxmon train` as one of several processes: what it detects, and `--processes N`.

The detection and the launcher's handling of its children (output, a failed child,
Ctrl-C) are tested with fake children, small scripts that need no JAX; the slow tests
run `jaxmon train --processes 2` on a tiny config (two CPU devices each) to the end,
and stopped by Ctrl-C. A child SIGKILLed and the run resumed: `configs/lm_fsdp.py` as
two processes, in tests/end_to_end/test_experiment_scale.py.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
import warnings
from pathlib import Path

import pytest
import warm_processes
from helpers import ROOT, cpu_env, tiny_config, with_helpers_path

import jaxmon as jm
from jaxmon._base.errors import ConfigError
from jaxmon._processes import launch as _launch
from jaxmon._processes import local as _local_processes

RESULT = re.compile(r"step (\d+): test accuracy ([\d.]+), loss ([\d.]+)  \((.+)\)")


# -- detection ------------------------------------------------------------------------------------


@pytest.fixture
def alone(monkeypatch):
    """No JAX_* variable, and none of the clusters JAX detects; `connect` records the
    connections it makes instead of making them."""
    for name in list(os.environ):
        if name.startswith(("JAX_COORDINATOR", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID", "SLURM_", "OMPI_", "TPU_",
                            "KUBERNETES_", "MEGASCALE_")):
            monkeypatch.delenv(name)
    connections = []
    monkeypatch.setattr(jm.distributed, "initialize", lambda *args, **kwargs: connections.append((args, kwargs)))
    return connections


def test_without_variables_a_process_is_alone_and_does_not_connect(alone):
    assert _launch.detect() == (1, "")
    assert _launch.connect().processes == 1 and alone == []


def test_jax_variables_make_it_one_of_several_and_it_connects(alone, monkeypatch):
    monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "10.0.0.1:1234")
    monkeypatch.setenv("JAX_NUM_PROCESSES", "4")
    monkeypatch.setenv("JAX_PROCESS_ID", "3")
    assert _launch.detect() == (4, "JAX_NUM_PROCESSES")
    assert _launch.connect() == (4, "JAX_NUM_PROCESSES")
    assert alone == [((), {})]  # JAX reads the variables itself
    monkeypatch.setenv("JAX_NUM_PROCESSES", "1")  # one process: nothing to connect to
    assert _launch.connect().processes == 1 and len(alone) == 1


def test_a_slurm_job_of_several_tasks_is_detected_as_jax_detects_it(alone, monkeypatch):
    for name, value in {"SLURM_JOB_ID": "77", "SLURM_STEP_NODELIST": "node[1-2]", "SLURM_NTASKS": "2",
                        "SLURM_PROCID": "1", "SLURM_LOCALID": "0"}.items():
        monkeypatch.setenv(name, value)
    assert _launch.detect() == (2, "SLURM")
    assert _launch.connect().processes == 2 and len(alone) == 1
    monkeypatch.setenv("SLURM_NTASKS", "1")  # one task: alone
    assert _launch.detect() == (1, "SLURM") and _launch.connect().processes == 1 and len(alone) == 1


def test_a_kubernetes_pod_without_the_package_is_alone_and_quiet(alone, monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "kubernetes", None)  # `import kubernetes` fails, installed or not
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.0.0.1")
    with warnings.catch_warnings(record=True) as caught, caplog.at_level("INFO", logger="jaxmon"):
        warnings.simplefilter("always")
        assert _launch.connect() == (1, "") and alone == []
    assert caught == [] and "Kubernetes environment detected" in caplog.text  # an INFO line, no warning


@pytest.mark.parametrize("variables, words", [
    ({"JAX_NUM_PROCESSES": "2"}, ["JAX_COORDINATOR_ADDRESS and JAX_PROCESS_ID not set", "0 to 1"]),
    ({"JAX_NUM_PROCESSES": "two"}, ["JAX_NUM_PROCESSES='two'", "whole number"]),
    ({"JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "2", "JAX_COORDINATOR_ADDRESS": "h:1"}, ["JAX_PROCESS_ID=2"]),
    ({"JAX_COORDINATOR_ADDRESS": "h:1"}, ["JAX_COORDINATOR_ADDRESS set, but not JAX_NUM_PROCESSES"]),
])
def test_incomplete_jax_variables_are_a_clear_error(alone, monkeypatch, variables, words):
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError) as error:
        _launch.connect()
    assert all(word in str(error.value) for word in words), str(error.value)
    assert alone == []


def test_the_children_command_drops_processes_in_each_spelling():
    argv = ["train", "--config", "c.py", "--processes", "2", "--workdir", "w", "--proc=2", "--config.steps=4"]
    assert _local_processes.without_processes(argv) == ["train", "--config", "c.py", "--workdir", "w",
                                                        "--config.steps=4"]


@pytest.mark.parametrize("value", ["abc", "0", "-1", "1.5", ""])
def test_processes_must_be_a_whole_number_of_at_least_one(value):
    with pytest.raises(ConfigError, match=re.escape(f"--processes={value!r}: give a whole number")):
        _local_processes.processes_option(value)
    assert _local_processes.processes_option("3") == 3 and _local_processes.processes_option(None) == 1


def test_a_bad_processes_exits_2_with_one_line(tmp_path):
    result = subprocess.run([sys.executable, "-m", "jaxmon", "train", "--config", str(ROOT / "configs" / "default.py"),
                             "--workdir", str(tmp_path / "run"), "--processes", "two"],
                            capture_output=True, text=True, timeout=120, cwd=ROOT, env=cpu_env())
    assert result.returncode == 2
    assert result.stderr.splitlines() == ["jaxmon train: --processes='two': give a whole number of processes >= 1 "
                                          "(e.g. --processes 2; 1 is a plain run)."]
    assert not (tmp_path / "run").exists()


def test_train_help_explains_several_hosts_and_processes():
    result = subprocess.run([sys.executable, "-m", "jaxmon", "train", "--help"], capture_output=True, text=True,
                            timeout=120, cwd=ROOT, env=cpu_env())
    assert result.returncode == 0
    for words in ("[--processes N]", "JAX_COORDINATOR_ADDRESS", "SLURM", "DIR/process-<i>.log",
                  "XLA_FLAGS=--xla_force_host_platform_device_count=4 gives each\n4 CPU devices"):
        assert words in result.stdout, words


# -- the launcher, with fake children -------------------------------------------------------------

FAKE = textwrap.dedent('''
    import os, signal, sys, time
    i, count, mode, ready = int(os.environ["JAX_PROCESS_ID"]), os.environ["JAX_NUM_PROCESSES"], sys.argv[1], sys.argv[2]
    print(f"process {i} of {count} at {os.environ['JAX_COORDINATOR_ADDRESS']} on {os.environ['JAX_PLATFORMS']}")
    print(f"12:00:00{' INFO' if i else ''} an info line of {i}", file=sys.stderr)
    print(f"I1125 12:00:00.000000 {os.getpid()} cc:1] a C++ info line of {i}", file=sys.stderr)
    if mode == "lost":  # process 1 is killed; its peer notices (exit 75) before its end shows
        if i == 0:
            while not os.path.exists(os.path.join(ready, "ready-1")):
                time.sleep(0.01)
            sys.exit(75)
        open(os.path.join(ready, "ready-1"), "w").close()
        time.sleep(0.2)
        os.kill(os.getpid(), signal.SIGKILL)
    if mode == "fail" and i == 1:  # once process 0 ignores SIGTERM
        while not os.path.exists(os.path.join(ready, "ready-0")):
            time.sleep(0.01)
        print("12:00:01 WARNING process 1 fails", file=sys.stderr)
        sys.exit(3)
    if mode in ("stubborn", "fail"):  # only SIGKILL ends it
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    elif mode == "saves":  # as a session does: save, then exit 143
        def save(*_):
            open(os.path.join(ready, f"saved-{i}"), "w").close()
            print(f"saved {i}", flush=True)  # BrokenPipeError where the launcher that read it has died
            os._exit(143)
        signal.signal(signal.SIGTERM, save)
    open(os.path.join(ready, f"ready-{i}"), "w").close()
    if mode != "ok":
        time.sleep(60)
''')


@pytest.fixture
def fake(tmp_path):
    """Runs the launcher over 2 fake children in `mode`; returns (exit code, seconds, launcher)."""
    script = tmp_path / "fake.py"
    script.write_text(FAKE)

    def launch(mode, *, grace_secs=1.0, meanwhile=None):
        logs = [str(tmp_path / f"process-{i}.log") for i in range(2)]
        children = _local_processes._Children([sys.executable, "-u", str(script), mode, str(tmp_path)],
                                              "127.0.0.1:1", logs, grace_secs)
        if meanwhile:
            threading.Thread(target=meanwhile, args=(children,), daemon=True).start()
        start = time.monotonic()
        code = children.run()
        return code, time.monotonic() - start, children

    return launch


def _when_ready(directory, action):
    def wait_then_act(children):
        deadline = time.monotonic() + 30
        while not all((directory / f"ready-{i}").exists() for i in range(2)):
            assert time.monotonic() < deadline
            time.sleep(0.02)
        action(children)
    return wait_then_act


def test_children_get_the_variables_and_process_1_goes_to_its_log(fake, tmp_path, capfd):
    code, _, _ = fake("ok")
    out, err = capfd.readouterr()
    assert code == 0
    assert re.search(r"^process 0 of 2 at 127.0.0.1:1 on cpu$", out, re.M)  # process 0: shown as it is
    assert "12:00:00 an info line of 0" in err
    log = (tmp_path / "process-1.log").read_text()
    header = log.splitlines()[0]
    assert header.startswith("==== ") and f"process 1 of 2: {sys.executable} -u " in header
    assert "process 1 of 2 at 127.0.0.1:1 on cpu\n" in log and "12:00:00 INFO an info line of 1\n" in log
    assert "info line of 1" not in err and "process 1 of 2" not in out + err  # they stay in its log
    assert "] a C++ info line of 1" in log


def test_a_failed_child_stops_the_others_and_gives_its_code(fake, tmp_path, capfd):
    code, seconds, children = fake("fail", grace_secs=1.0)  # process 0 ignores SIGTERM: SIGKILL after 1 s
    err = capfd.readouterr().err
    assert code == 3 and seconds < 10, seconds
    assert [p.returncode for p in children._processes] == [-signal.SIGKILL, 3]
    assert "[process 1] 12:00:01 WARNING process 1 fails\n" in err and "INFO an info line of 1" not in err
    log = tmp_path / "process-1.log"
    assert f"jaxmon train: process 1 of 2 exited with code 3 (its log is {log}); the other processes were " \
           "stopped.\n" in err
    assert "12:00:01 WARNING process 1 fails" in log.read_text()


def test_a_child_that_lost_its_peer_first_does_not_hide_the_peers_death(fake, tmp_path, capfd):
    code, seconds, children = fake("lost")
    err = capfd.readouterr().err
    assert code == 137 and [p.returncode for p in children._processes] == [75, -signal.SIGKILL], err
    assert err.endswith(f"jaxmon train: process 1 of 2 was killed by SIGKILL (its log is {tmp_path}/process-1.log); "
                        "the other processes were stopped.\n"), err


def test_a_killed_child_gives_128_plus_the_signal(fake, tmp_path, capfd):
    code, seconds, children = fake("saves", meanwhile=_when_ready(
        tmp_path, lambda children: os.kill(children._processes[1].pid, signal.SIGKILL)))
    out, err = capfd.readouterr()
    assert code == 137 and seconds < 30
    assert [p.returncode for p in children._processes] == [143, -signal.SIGKILL]  # process 0 stopped by SIGTERM
    assert "saved 0" in out and "process 1 of 2 was killed by SIGKILL" in err


def test_ctrl_c_reaches_every_child_as_sigterm_and_the_launcher_exits_130(fake, tmp_path, capfd):
    code, _, children = fake("saves", meanwhile=_when_ready(
        tmp_path, lambda children: os.kill(os.getpid(), signal.SIGINT)))  # the launcher runs in this thread
    out, err = capfd.readouterr()
    assert code == 130 and [p.returncode for p in children._processes] == [143, 143]
    assert "saved 0" in out and "saved 1" in (tmp_path / "process-1.log").read_text()
    assert "jaxmon train: stopped by Ctrl-C: every process saved and stopped; run the same command" in err


def test_a_second_ctrl_c_kills_every_child(fake, tmp_path, capfd):
    def twice(children):
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGINT)

    code, seconds, children = fake("stubborn", meanwhile=_when_ready(tmp_path, twice))
    err = capfd.readouterr().err
    assert code == 130 and seconds < 30
    assert [p.returncode for p in children._processes] == [-signal.SIGKILL] * 2
    assert "a second Ctrl-C stops them at once" in err and "process 0 of 2 was killed by SIGKILL" in err


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_killed_launcher_leaves_no_child_training(tmp_path):
    """SIGKILL to the launcher (which cannot pass it on) reaches each child as SIGTERM."""
    (tmp_path / "fake.py").write_text(FAKE)
    launcher = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys
        from jaxmon._processes.local import _Children
        logs = [{str(tmp_path / "process-0.log")!r}, {str(tmp_path / "process-1.log")!r}]
        _Children([sys.executable, "-u", {str(tmp_path / "fake.py")!r}, "saves", {str(tmp_path)!r}],
                  "127.0.0.1:1", logs, 1.0).run()
    """)], cwd=ROOT, env=cpu_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while not all((tmp_path / f"ready-{i}").exists() for i in range(2)):
            assert launcher.poll() is None and time.monotonic() < deadline, launcher.communicate()
            time.sleep(0.05)
        children = [int(pid) for pid in Path(f"/proc/{launcher.pid}/task/{launcher.pid}/children").read_text().split()]
        launcher.kill()
        out = launcher.communicate(timeout=30)[0]
        deadline = time.monotonic() + 30
        while any(_running(pid) for pid in children) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(_running(pid) for pid in children)
        assert "saved 0" in out and (tmp_path / "saved-1").exists()  # each took SIGTERM
    finally:
        for pid in children if "children" in locals() else ():
            if _running(pid):
                os.kill(pid, signal.SIGKILL)
        launcher.kill()


def _running(pid: int) -> bool:
    """Whether `pid` is a live process (not ended, not a zombie)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


# -- jaxmon train --processes 2, on helpers.tiny_config -------------------------------------------


def _launch_processes(config: Path, workdir: Path, **popen) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "jaxmon", "train", "--config", str(config), "--workdir",
                             str(workdir), "--processes", "2"], cwd=ROOT, env=cpu_env(2), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, **popen)


def _finish(launcher: subprocess.Popen, timeout: float = 300) -> tuple[str, str]:
    """The launcher's output once it ends (killed, with its children, if it outlives `timeout`)."""
    try:
        return launcher.communicate(timeout=timeout)
    finally:
        _stop(launcher)


def _stop(launcher: subprocess.Popen) -> None:
    """Kills the launcher and its children, if still there (a failed test leaves none behind)."""
    for pid in _children(launcher.pid).values():
        os.kill(pid, signal.SIGKILL)
    launcher.kill()
    launcher.wait(timeout=30)


def _children(pid: int) -> dict[int, int]:
    """The JAX processes a launcher started: {JAX_PROCESS_ID: pid}."""
    try:
        pids = [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return {}
    found = {}
    for child in pids:
        try:
            env = dict(item.split("=", 1) for item in Path(f"/proc/{child}/environ").read_text().split("\0") if item)
        except OSError:
            continue
        if "JAX_PROCESS_ID" in env:
            found[int(env["JAX_PROCESS_ID"])] = child
    return found


def _wait_for_checkpoint(workdir: Path, launcher: subprocess.Popen, step: int) -> None:
    deadline = time.monotonic() + 240
    while (jm.latest_checkpoint_step(workdir) or 0) < step:
        assert launcher.poll() is None, launcher.communicate()
        assert time.monotonic() < deadline, f"no checkpoint {step} in {workdir}"
        time.sleep(0.2)


def _signal_after_checkpoint_20(tmp_path: Path, signum: int, victim: int) -> tuple[int, str, str, float]:
    """A `--processes 2` run on and on; child `victim` gets `signum` after checkpoint 20. The
    launcher's exit code, output, and the seconds it took to end after the signal."""
    workdir = tmp_path / "run"
    launcher = _launch_processes(tiny_config(tmp_path, steps=10_000, sleep=0.02), workdir)
    try:
        _wait_for_checkpoint(workdir, launcher, 20)
        os.kill(_children(launcher.pid)[victim], signum)
        start = time.monotonic()
        out, err = launcher.communicate(timeout=60)
        seconds = time.monotonic() - start
    finally:
        _stop(launcher)
    print(f"{signal.Signals(signum).name} of process {victim}: the launcher ended {seconds:.2f} s later, exit "
          f"{launcher.returncode}")
    return launcher.returncode, out, err, seconds


@pytest.fixture(scope="module")
def to_the_end(tmp_path_factory):
    """`jaxmon train --processes 2` on a tiny config to step 40: (its workdir, the launcher's
    exit code, stdout and stderr)."""
    directory = tmp_path_factory.mktemp("to-the-end")
    launcher = _launch_processes(tiny_config(directory, steps=40), directory / "run")
    out, err = _finish(launcher)
    return directory / "run", launcher.returncode, out, err


@pytest.mark.processes
@pytest.mark.slow
def test_two_processes_train_to_the_end_and_the_chief_writes_the_run(to_the_end):
    workdir, code, out, err = to_the_end
    assert code == 0, err[-3000:]
    lines = out.strip().splitlines()
    assert lines[0].startswith("Training in 2 processes on the CPU of this machine (coordinator 127.0.0.1:")
    assert RESULT.fullmatch(lines[-1]) and int(RESULT.fullmatch(lines[-1])[1]) == 40, out
    # Process 1 (two CPU devices of four) logged to its file, and ended as process 0 did.
    log = (workdir / "process-1.log").read_text()
    assert "[process 1/2] Process 1 of 2, 2 local of 4 devices." in log
    assert RESULT.search(log) and RESULT.search(log)[1] == "40"
    # The chief alone wrote the summaries: one event file, one metrics line a step.
    assert len(list(workdir.glob("events.out.tfevents.*"))) == 1
    steps = [json.loads(line).get("step") for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    steps = [step for step in steps if step is not None]
    assert steps == sorted(set(steps)) and steps[-1] == 40 and {1, 10, 20, 30} <= set(steps)
    # Every checkpoint is complete and restores.
    assert sorted(int(p.name) for p in workdir.iterdir() if p.name.isdigit()) == [0, 20, 40]
    assert jm.latest_checkpoint_step(workdir) == 40
    restored = jm.restore_checkpoint(workdir)
    assert restored.step == 40 and restored.meta["config"]["steps"] == 40


@pytest.mark.processes
@pytest.mark.slow
def test_a_resume_in_two_processes_is_quiet_about_the_chiefs_windows(to_the_end, tmp_path):
    """Process 1 declares the chief's summary windows (`Declared`): the chief's checkpoint
    holds the same windows, so its resume restores them without a warning. The run to 40
    (a copy of its workdir) goes on to 50."""
    workdir = tmp_path / "run"
    trained, code, out, err = to_the_end
    assert code == 0 and RESULT.search(out), err[-3000:]
    shutil.copytree(trained, workdir)
    launcher = _launch_processes(tiny_config(tmp_path, steps=50), workdir)
    out, err = _finish(launcher)
    assert launcher.returncode == 0 and RESULT.search(out)[1] == "50", err[-3000:]
    log = (workdir / "process-1.log").read_text()
    assert "[process 1/2] Restored step 40 from" in log, log[-2000:]
    # No warning of any kind but a straggler's, which a loaded machine can make of either process.
    warnings = [line for line in log.splitlines() if "WARNING" in line and "is a straggler" not in line]
    assert "holds the windows" not in log + out + err and not warnings, log[-3000:]


@pytest.mark.processes
@pytest.mark.slow
def test_a_hung_worker_ends_the_launch_with_75_and_one_line_within_30_seconds(tmp_path):
    """Process 1 stopped (SIGSTOP): process 0 ends at the heartbeat timeout with 75, and the
    launcher stops process 1 and ends with 75, after one line naming process 0."""
    code, out, err, seconds = _signal_after_checkpoint_20(tmp_path, signal.SIGSTOP, victim=1)
    assert code == 75 and seconds < 30, (seconds, err[-3000:])
    assert err.strip().splitlines()[-1] == ("jaxmon train: process 0 of 2 exited with code 75 (its output is above); "
                                            "the other processes were stopped."), err[-3000:]
    assert "stopped answering" in err and "Traceback" not in err and not re.search(r"^[EF]\d{4} ", err, re.M), err


@pytest.mark.processes
@pytest.mark.slow
@pytest.mark.parametrize("victim", [1, 0], ids=["process-1-dies", "the-coordinator-dies"])
def test_a_killed_process_ends_the_launch_within_30_seconds_with_one_line_and_nothing_native(tmp_path, victim):
    """SIGKILL of one child after checkpoint 20: the other ends (the launcher stops it, if
    it has not noticed by itself), and the launcher ends with the dead child's code and
    one line naming it; no traceback of any thread and no native log line around it."""
    workdir = tmp_path / "run"
    code, out, err, seconds = _signal_after_checkpoint_20(tmp_path, signal.SIGKILL, victim)
    assert code == 128 + signal.SIGKILL and seconds < 30, (seconds, err[-3000:])
    assert err.strip().splitlines()[-1] == (f"jaxmon train: process {victim} of 2 was killed by SIGKILL (its log is "
                                            f"{workdir}/process-1.log); the other processes were stopped."
                                            if victim else "jaxmon train: process 0 of 2 was killed by SIGKILL "
                                            "(its output is above); the other processes were stopped."), err[-3000:]
    output = out + err + (workdir / "process-1.log").read_text()
    assert "Traceback" not in output and not re.search(r"^[EF]\d{4} ", output, re.M), output[-3000:]
    assert 20 <= jm.latest_checkpoint_step(workdir)  # the complete checkpoints stand


@pytest.mark.processes
@pytest.mark.slow
def test_ctrl_c_saves_every_process_at_one_step_and_exits_130(tmp_path):
    workdir = tmp_path / "run"
    launcher = _launch_processes(tiny_config(tmp_path, steps=10_000, sleep=0.05), workdir)
    try:
        _wait_for_checkpoint(workdir, launcher, 20)
        launcher.send_signal(signal.SIGINT)
        out, err = launcher.communicate(timeout=120)
    finally:
        _stop(launcher)
    assert launcher.returncode == 130, err[-3000:]
    # One stop line, the launcher's, naming the step every process saved; the children say none.
    stopped = re.findall(r"Stopped by .+ at step (\d+); checkpoint \d+ is saved", out + err)
    assert len(stopped) == 1, out + err
    assert err.rstrip().endswith(f"jaxmon train: Stopped by Ctrl-C at step {stopped[0]}; checkpoint {stopped[0]} is "
                                 "saved: run the same command to resume."), err[-3000:]
    assert "Stopped by" not in (workdir / "process-1.log").read_text()
    assert "[Gloo]" not in out + err + (workdir / "process-1.log").read_text()  # Gloo's C++ line: --debug only
    assert not re.search(r"\[process 1\].*saving at the next step boundary", err)  # INFO: the launcher said it
    assert jm.latest_checkpoint_step(workdir) == int(stopped[0]) >= 20


@pytest.mark.slow
def test_processes_1_is_a_plain_run(tmp_path):
    workdir = tmp_path / "run"
    result = subprocess.run([sys.executable, "-m", "jaxmon", "train", "--config", str(tiny_config(tmp_path, steps=10)),
                             "--workdir", str(workdir), "--processes=1"], cwd=ROOT, env=cpu_env(2),
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert RESULT.fullmatch(result.stdout.strip())  # no launcher's line, no [process i/n] prefix: one process
    assert "[process" not in result.stderr and "One of" not in result.stderr
    assert not list(workdir.glob("process-*.log")) and jm.latest_checkpoint_step(workdir) == 10


class _Ended:
    """A child that has ended with `returncode` before the launcher first looks."""

    def __init__(self, returncode):
        self.returncode = returncode

    def poll(self):
        return self.returncode


@pytest.mark.parametrize("codes, blamed", [([0, -signal.SIGKILL], 1), ([-signal.SIGABRT, -signal.SIGKILL], 1),
                                           ([75, 3], 1), ([75, 0], 0), ([0, 0], None)])
def test_children_that_end_within_one_poll_still_fail_the_launch_naming_the_likeliest_cause(tmp_path, codes,
                                                                                             blamed):
    # A SIGKILLed process 1 and a process 0 that its death ended a millisecond later: both
    # seen ended at the launcher's first look still make a failed launch (it gave 0).
    children = _local_processes._Children(["true"], "127.0.0.1:1", [str(tmp_path / f"{i}.log") for i in range(2)],
                                          1.0)
    children._processes = [_Ended(code) for code in codes]
    assert children._watch() == (blamed, None)


@pytest.mark.processes
def test_a_process_whose_peers_never_come_ends_after_its_timeout_with_a_connection_error_naming_the_fix(tmp_path):
    """Process 0 of 2 alone: `jm.distributed.initialize(initialization_timeout=5)` raises
    after 5 s, once (no traceback at exit from JAX's shutdown), and the coordination
    service's own wait was the same 5 s (JAX leaves it at an hour)."""
    script = tmp_path / "alone.py"
    script.write_text(textwrap.dedent("""\
        import time
        import jaxmon as jm
        from helpers import free_port
        start = time.monotonic()
        try:
            jm.distributed.initialize(f"127.0.0.1:{free_port()}", num_processes=2, process_id=0,
                                      initialization_timeout=5)
        except ConnectionError as error:
            print(f"after {time.monotonic() - start:.1f} s: {error}")
        """))
    done = warm_processes.run([sys.executable, str(script)], cwd=ROOT, env=with_helpers_path(cpu_env()),
                              capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    seconds, message = done.stdout.split(" s: ", 1)
    assert 5 <= float(seconds.removeprefix("after ")) < 15, done.stdout
    assert message.startswith("JAX process 0 of 2 could not connect to the others (coordinator 127.0.0.1:")
    assert "within initialization_timeout=5 s: start every process with the same JAX_COORDINATOR_ADDRESS" in message
    assert "Traceback" not in done.stderr and "currently set to: 1h" not in done.stderr, done.stderr[-3000:]
