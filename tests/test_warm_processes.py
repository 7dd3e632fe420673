"""The tests' warm `jaxmon` processes (`tests/warm_processes.py`): a child forked from one
sees and does what a fresh `python -m jaxmon` would."""

import json
import os
import subprocess
import sys
import textwrap
import time

import pytest
import warm_processes
from helpers import DEFAULT, ROOT, cpu_env, read_jsonl

#: A config that prints what the process it runs in sees, then fails (exit 2).
PROBE = textwrap.dedent("""
    import json, os, signal, sys
    import jax
    print(json.dumps({"cwd": os.getcwd(), "argv": sys.argv, "path0": sys.path[0], "marker": os.environ.get("MARKER"),
                      "devices": len(jax.devices()), "stdin": sys.stdin.read(),
                      "main": sys.modules["__main__"].__file__,
                      "sigint": getattr(signal.getsignal(signal.SIGINT), "__qualname__", None),
                      "sigpipe": repr(signal.getsignal(signal.SIGPIPE)),
                      "stdout_buffered": not sys.stdout.write_through, "stderr_lines": sys.stderr.line_buffering,
                      "log_level": os.environ.get("TF_CPP_MIN_LOG_LEVEL")}))
    print("to stderr", file=sys.stderr)

    def get_config():
        raise ValueError("probed")
""")


def both(args, env, timeout=120):
    """`jaxmon ARGS` from a warm process and from a fresh one."""
    warm = warm_processes.run_jaxmon(args, cwd=ROOT, env=env, timeout=timeout)
    fresh = subprocess.run([sys.executable, "-m", "jaxmon", *args], capture_output=True, text=True, cwd=ROOT,
                           env=env, timeout=timeout, stdin=subprocess.DEVNULL)
    return warm, fresh


@pytest.mark.parametrize("unbuffered", ["1", None])
def test_a_child_sees_the_command_line_directory_environment_streams_and_devices_a_fresh_process_sees(
        tmp_path, unbuffered):
    probe = tmp_path / "probe.py"
    probe.write_text(PROBE)
    env = {**cpu_env(devices=3), "MARKER": "here"}
    if unbuffered:
        env["PYTHONUNBUFFERED"] = unbuffered
    warm, fresh = both(["train", "--config", str(probe), "--workdir", str(tmp_path / "run")], env)
    assert warm.returncode == fresh.returncode == 2, (warm.stderr, fresh.stderr)
    assert json.loads(warm.stdout.splitlines()[0]) == json.loads(fresh.stdout.splitlines()[0])
    assert json.loads(warm.stdout.splitlines()[0])["devices"] == 3 and '"marker": "here"' in warm.stdout
    assert warm.stdout == fresh.stdout
    assert warm.stderr == fresh.stderr
    assert warm.stderr.startswith("to stderr\n") and "probed" in warm.stderr.splitlines()[-1]


def test_a_run_to_its_end_prints_and_saves_what_a_fresh_process_does(tmp_path):
    args = ["train", "--config", DEFAULT, "--config.steps=20", "--config.session.save_checkpoint_steps=None"]
    warm = warm_processes.run_jaxmon([*args, "--workdir", tmp_path / "warm"], cwd=ROOT, env=cpu_env(), timeout=240)
    fresh = subprocess.run([sys.executable, "-m", "jaxmon", *args, "--workdir", str(tmp_path / "fresh")],
                           capture_output=True, text=True, cwd=ROOT, env=cpu_env(), timeout=240,
                           stdin=subprocess.DEVNULL)
    assert warm.returncode == fresh.returncode == 0, warm.stderr[-2000:]
    assert warm.stdout.replace("warm", "fresh") == fresh.stdout and warm.stdout.startswith("step 20: test accuracy")
    names = {run: sorted(name.split(".tfevents.")[0] for name in os.listdir(tmp_path / run))
             for run in ("warm", "fresh")}
    assert names["warm"] == names["fresh"] and "metrics.jsonl" in names["warm"]
    records = {run: [sorted(record) for record in read_jsonl(tmp_path / run / "metrics.jsonl")]
               for run in ("warm", "fresh")}
    assert records["warm"] == records["fresh"] and records["warm"]


def test_a_bad_command_line_exits_as_a_fresh_process_does(tmp_path):
    warm, fresh = both(["train", "--no-such-flag"], cpu_env())
    assert (warm.returncode, warm.stdout, warm.stderr) == (fresh.returncode, fresh.stdout, fresh.stderr)
    assert warm.returncode == 2 and "required: --config, --workdir" in warm.stderr


def test_a_child_past_its_timeout_is_killed_and_timeout_expired_raised_with_its_output(tmp_path):
    probe = tmp_path / "slow.py"
    probe.write_text("import sys, time\nprint('started', flush=True)\ntime.sleep(600)\n")
    began = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired) as raised:
        warm_processes.run_jaxmon(["train", "--config", probe, "--workdir", tmp_path / "run"], cwd=ROOT,
                                  env=cpu_env(), timeout=3)
    assert time.monotonic() - began < 60
    assert raised.value.output == b"started\n"  # bytes, as subprocess.run gives them
    # the warm process serves the next run
    again = warm_processes.run_jaxmon(["train", "--no-such-flag"], cwd=ROOT, env=cpu_env(), timeout=60)
    assert again.returncode == 2
