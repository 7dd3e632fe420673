"""The tests' warm processes (`tests/warm_processes.py`): a child forked from one sees
and does what a fresh `python -m jaxmon` or `python SCRIPT.py` would, as the test's own
child."""

import json
import os
import signal
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
                                  env=cpu_env(), timeout=10)
    assert time.monotonic() - began < 60
    assert raised.value.output == b"started\n"  # bytes, as subprocess.run gives them
    # the warm process serves the next run
    again = warm_processes.run_jaxmon(["train", "--no-such-flag"], cwd=ROOT, env=cpu_env(), timeout=60)
    assert again.returncode == 2


#: A script that prints what the process it runs in sees, then waits for a line on stdin.
SCRIPT_PROBE = textwrap.dedent("""
    import json, os, sys
    import jax
    import tempfile
    x: int = 1
    print(json.dumps({"argv": sys.argv, "path": sys.path, "file": __file__, "name": __name__,
                      "annotation": repr(__annotations__["x"]),
                      "temp": tempfile.gettempdir(),
                      "parent": os.getppid(), "leader": os.getsid(0) == os.getpid(), "cwd": os.getcwd(),
                      "marker": os.environ.get("MARKER"), "devices": len(jax.devices())}), flush=True)
    print("ready", sys.stdin.readline().strip(), file=sys.stderr)
    sys.exit(int(sys.argv[1]))
""")


@pytest.mark.parametrize("new_session", [False, True], ids=["same-session", "new-session"])
def test_a_script_from_popen_is_this_process_s_child_and_sees_what_a_fresh_one_sees(tmp_path, new_session):
    script = tmp_path / "probe.py"
    script.write_text(SCRIPT_PROBE)
    (tmp_path / "temp").mkdir()
    env = {**cpu_env(devices=2), "MARKER": "here", "PYTHONPATH": f"lib{os.pathsep}{tmp_path / 'more'}",
           "TMPDIR": str(tmp_path / "temp")}
    seen = {}
    for how, start in (("warm", warm_processes.popen), ("fresh", subprocess.Popen)):
        process = start([sys.executable, str(script), "3"], cwd=tmp_path, env=env, stdin=subprocess.PIPE,
                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=new_session)
        out, err = process.communicate("go\n", timeout=120)
        assert process.returncode == 3 and err == "ready go\n", err
        seen[how] = (type(process), json.loads(out))
    assert seen["warm"][0] is not subprocess.Popen and seen["fresh"][0] is subprocess.Popen  # forked warm indeed
    assert seen["warm"][1] == seen["fresh"][1]
    assert seen["warm"][1]["parent"] == os.getpid() and seen["warm"][1]["leader"] is new_session
    assert seen["warm"][1]["argv"] == [str(script), "3"] and seen["warm"][1]["devices"] == 2
    assert seen["warm"][1]["path"][:3] == [str(tmp_path), str(tmp_path / "lib"), str(tmp_path / "more")]
    assert seen["warm"][1]["temp"] == str(tmp_path / "temp")
    assert seen["warm"][1]["annotation"] == "<class 'int'>"  # not this module's postponed annotations


def test_a_child_from_popen_takes_signals_and_its_exit_is_this_process_s_to_wait_for(tmp_path):
    script = tmp_path / "sleeps.py"
    script.write_text("import sys, time\nprint('up', flush=True)\ntime.sleep(600)\n")
    process = warm_processes.popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                                   env=cpu_env())
    try:
        assert process.stdout.readline() == "up\n" and process.poll() is None
        assert open(f"/proc/{process.pid}/stat").read().split()[3] == str(os.getpid())
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == -signal.SIGTERM
    finally:
        process.kill()  # a failed assertion leaves no sleeper behind
        process.wait()
