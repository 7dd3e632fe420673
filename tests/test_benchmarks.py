"""The benchmark scripts run, produce the figures RESULTS.md quotes, and skip a peer
whose environment is missing or broken with a message. No timing is asserted.
`transformer_overhead.py`'s and `host_cost.py`'s runs are the small GPU check's
(tests/test_gpu_check.py)."""

import itertools
import json
import os
import pathlib
import subprocess
import sys

import jax.numpy as jnp
import pytest
import warm_processes
from helpers import load_benchmark

import jaxmon as jm

ROOT = pathlib.Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"
LOCAL = ["bare_jit", "bare_scan32", "session_no_hooks", "mts_default", "mts_default_k32", "naive"]


def run(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")}
    result = warm_processes.run([sys.executable, *args], capture_output=True, text=True, timeout=300, cwd=BENCHMARKS,
                                env=env, input=stdin)
    assert result.returncode == 0, f"{args} failed:\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}"
    return result


def test_suite_times_every_variant_and_skips_peers_it_cannot_start(tmp_path):
    # A peer environment whose Python lacks the peer's libraries: the worker fails to start.
    for env in ("keras", "tf"):
        (tmp_path / env / "bin").mkdir(parents=True)
        (tmp_path / env / "bin" / "python").symlink_to(sys.executable)
    result = run("suite.py", "--steps", "64", "--warmup", "40", "--rounds", "1", "--peers-dir", str(tmp_path))
    report = json.loads(result.stdout)
    assert sorted(report["median_us_per_step"]) == sorted(LOCAL)
    assert all(value > 0 for value in report["median_us_per_step"].values())
    assert report["ratio_to_bare_jit"]["bare_jit"] == 1.0
    assert report["ratio_to_bare_scan32"]["bare_scan32"] == 1.0
    assert sorted(report["skipped"]) == ["keras_fit", "keras_fit_spe32", "tf1_mts"]
    for variant in ("keras_fit", "tf1_mts"):  # the worker's own traceback says why
        assert "ModuleNotFoundError: No module named" in report["skipped"][variant]
    assert "skipped tf1_mts: its worker failed to start" in result.stderr
    assert report["versions"]["jaxmon"] and report["versions"]["orbax-checkpoint"]


FAKE_PEER = """
import os, sys
sys.path.insert(0, {peers!r})
from serve import serve
requests = []
def measure(variant, steps, warmup):
    requests.append(variant)
    if len(requests) == {dies_at}:
        print("fake peer: out of memory", file=sys.stderr, flush=True)
        os._exit(3)
    return 1000.0
serve(measure, {{"fake": "1"}})
"""


def fake_peer_environment(root: pathlib.Path, env: str, dies_at: int) -> None:
    """`root/env/bin/python`: a worker that answers 1000 µs a step, and exits at request `dies_at` (0: never)."""
    (root / env / "bin").mkdir(parents=True)
    worker = root / env / "worker.py"
    worker.write_text(FAKE_PEER.format(peers=str(BENCHMARKS / "peers"), dies_at=dies_at))
    python = root / env / "bin" / "python"
    python.write_text(f'#!/bin/sh\nexec {sys.executable} {worker}\n')  # the suite's script arguments left out
    python.chmod(0o755)


def test_a_peer_that_fails_while_measured_is_reported_and_the_others_go_on(tmp_path):
    fake_peer_environment(tmp_path, "keras", dies_at=3)  # round 2: keras_fit and keras_fit_spe32 answered once
    fake_peer_environment(tmp_path, "tf", dies_at=0)
    result = run("suite.py", "--steps", "32", "--warmup", "40", "--rounds", "2", "--peers-dir", str(tmp_path))
    report = json.loads(result.stdout)
    assert sorted(report["median_us_per_step"]) == sorted([*LOCAL, "tf1_mts"])
    assert report["median_us_per_step"]["tf1_mts"] == 1000.0 and report["skipped"] == {}
    assert sorted(report["failed"]) == ["keras_fit", "keras_fit_spe32"]
    for variant in ("keras_fit", "keras_fit_spe32"):  # the worker's exit, with its last line
        assert "exited with status 3: fake peer: out of memory" in report["failed"][variant]
    assert "failed keras_fit: the worker exited with status 3" in result.stderr
    assert report["versions"]["keras"] == report["versions"]["tf"] == {"fake": "1"}


def test_suite_says_where_to_get_a_missing_peer_environment(tmp_path):
    result = run("suite.py", "--steps", "8", "--warmup", "8", "--rounds", "1", "--peers-dir", str(tmp_path / "none"))
    report = json.loads(result.stdout)
    message = f"no environment at {tmp_path / 'none' / 'keras'} (make bench-peers)"
    assert report["skipped"]["keras_fit"] == message
    assert f"skipped keras_fit_spe32: {message}" in result.stderr


def test_peer_worker_protocol_answers_each_request_and_reports_errors():
    program = ("import sys; sys.path.insert(0, 'peers'); from serve import serve\n"
               "def measure(variant, steps, warmup):\n"
               "    if variant == 'bad': raise ValueError('no such variant')\n"
               "    print('library chatter')\n"
               "    return steps / 2 + warmup\n"
               "serve(measure, {'lib': '1.0'})\n")
    requests = [{"variant": "ok", "steps": 10, "warmup": 1}, {"variant": "bad", "steps": 1, "warmup": 0},
                {"variant": "ok", "steps": 4, "warmup": 0}]
    result = run("-c", program, stdin="".join(json.dumps(r) + "\n" for r in requests))
    lines = [json.loads(line) for line in result.stdout.splitlines()]
    assert lines == [{"versions": {"lib": "1.0"}}, {"us_per_step": 6.0},
                     {"error": "ValueError: no such variant"}, {"us_per_step": 2.0}]
    assert "library chatter" in result.stderr


def test_memory_child_reports_the_state_and_the_live_arrays():
    result = run("memory.py", "--child", "session_no_hooks", "--steps", "2")
    figures = json.loads(result.stdout.strip().splitlines()[-1])
    assert 240 < figures["state_mb"] < 241  # 1024-4096-4096-10 parameters and two Adam moments, float32
    assert figures["live_mb"] >= figures["state_mb"]
    assert figures["peak_mb"] >= figures["baseline_mb"] + figures["state_mb"]
    assert figures["loop_mb"] == figures["peak_mb"] - figures["baseline_mb"]


def test_trigger_pair_times_this_checkout_and_a_commit_in_one_process():
    result = run("trigger_pair.py", "--base", "HEAD", "--rounds", "1", "--cycles", "2", "--warmup", "30")
    report = json.loads(result.stdout)
    [figures] = report["rounds"]
    for tree in ("base", "this"):  # the commit's jaxmon, loaded beside this checkout's, ran its own session
        assert figures[f"{tree}_run_on_step_100n_us"] > 0 and figures[f"{tree}_quiet_run_us"] > 0
    assert sorted(report["median_ratio_this_over_base"]) == ["quiet_run", "run_after_it", "run_on_step_100n"]
    assert report["base"] == "HEAD"


def test_step_pair_times_the_bare_loop_and_both_trees_in_one_process():
    result = run("step_pair.py", "--base", "HEAD", "--rounds", "1", "--cycles", "3", "--steps", "20", "--warmup", "5")
    report = json.loads(result.stdout)
    [figures] = report["rounds"]
    assert all(figures[f"{loop}_us"] > 0 for loop in ("bare", "base", "this"))  # each loop ran and was timed
    assert abs(figures["this_over_bare"] - figures["this_us"] / figures["bare_us"]) < 0.01
    assert sorted(report["median"]) == sorted(figures) and report["base"] == "HEAD"


def test_step_parts_times_the_sessions_program_alone_and_the_set_quiet_and_as_usual():
    report = json.loads(run("step_parts.py", "--cycles", "4", "--steps", "20", "--warmup", "5").stdout)
    us = report["median_us_per_step"]
    assert sorted(us) == ["bare", "default_set", "program", "quiet"] and all(v > 0 for v in us.values())
    assert report["ratio_to_bare"]["bare"] == 1.0
    assert abs(report["ratio_to_bare"]["program"] - us["program"] / us["bare"]) < 0.01


def test_a_session_that_stops_without_an_error_is_said_to_have_stopped_early(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # for the `rotating` module it imports
    transformer_overhead = load_benchmark("transformer_overhead")
    sess = jm.MonitoredSession(lambda s, b: (s + b, {"loss": s}), lambda: jnp.zeros(()),
                               data=itertools.repeat(jnp.ones(())), hooks=[jm.StopAtStepHook(last_step=3)])
    with pytest.raises(transformer_overhead.Stopped) as stop:
        transformer_overhead.session_loop("default", sess)(10)
    assert str(stop.value) == "default stopped early at step 3: it closed without an error (a stop was requested)"


def test_startup_reports_each_part_of_the_start_up_line():
    result = run("startup.py", "--config", "configs/lm.py", "--rounds", "1", "--override", "model.num_layers=1")
    report = json.loads(result.stdout)
    [parts] = report["median_seconds"].values()
    assert list(parts)[:4] == ["total", "imports and config", "data and model", "state"]
    assert {"checkpoint 0", "session set-up", "compile", "the rest"} <= set(parts)
    assert all(value >= 0 for value in parts.values())
    assert sum(value for part, value in parts.items() if part != "total") == pytest.approx(parts["total"], abs=0.05)
