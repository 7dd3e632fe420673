"""The GPU check (`benchmarks/gpu_check.py`, `bash benchmarks/gpu.sh check`): every part
ends with its figures or one line saying why not, within the check's budget, and the
result is one file."""

import json
import os
import re
import shutil
import subprocess
import sys
import time

import pytest
from helpers import ROOT, load_benchmark

gpu_check = load_benchmark("gpu_check")


def fake_part(name, limit, code, read=None):
    return gpu_check.Part(name, limit, [sys.executable, "-c", code], read or gpu_check.read_timings)


def test_each_part_ends_with_its_figures_or_why_not_within_the_budget(tmp_path):
    report = {"median_us_per_step": {"bare": 100.0, "default": 102.0}, "ratio_to_bare": {"bare": 1.0, "default": 1.02}}
    parts = [fake_part("fine", 30, f"print({json.dumps(report)!r})"),
             fake_part("stops", 30, "print('{\"stopped\": \"default stopped early at step 3: NaN\"}'); exit(1)"),
             fake_part("crashes", 30, "print('working'); raise ValueError('bad value 3: pass 4')"),
             fake_part("hangs", 4, "print('started', flush=True); import time; time.sleep(60)"),
             fake_part("late", 30, "print('never')")]
    out, scratch = tmp_path / "out", tmp_path / "scratch"
    start = time.monotonic()
    results = gpu_check.run_check(parts, 8, str(out), str(scratch), ["- commit: abc"], min_part_s=5)
    assert time.monotonic() - start < 8  # the budget: the hanging part killed at its limit, the last never started
    lines = {r.name: (r.status, r.line) for r in results}
    assert lines["fine"] == ("ok", "bare 100.0 µs/step; × bare: default 1.02")
    assert lines["stops"] == ("failed (exit 1)", "a session stopped: default stopped early at step 3: NaN")
    assert lines["crashes"] == ("failed (exit 1)", "exit 1: ValueError: bad value 3: pass 4")
    assert lines["hangs"] == ("time limit", "stopped at its 4 s time limit; its last line: started")
    assert lines["late"][0] == "not run" and re.match(r"not run: \d s of the check's 8 s budget were left",
                                                      lines["late"][1])
    assert os.listdir(out) == ["gpu-check.md"]  # the logs are in the scratch directory
    text = (out / "gpu-check.md").read_text()
    assert "- commit: abc" in text and "| hangs | time limit | 4 | 4 | stopped at its 4 s" in text
    assert "### crashes: failed (exit 1)" in text and "ValueError: bad value 3" in text
    assert (scratch / "hangs.out").read_text() == "started\n"


def test_the_readers_name_failed_tests_and_a_run_that_stopped_early():
    pytest_output = ("..F.F\nFAILED tests/a.py::test_waits[8-auto] - AssertionError: 92 ms\n"
                     "FAILED tests/a.py::test_waits[8-1] - AssertionError\n2 failed, 5 passed in 38.12s\n")
    assert gpu_check.read_tests(pytest_output, "", 1).figures == \
        "2 failed, 5 passed in 38.12s; failed: test_waits[8-auto], test_waits[8-1]"
    log = ("10:00:01 Step 1 after 88.56 s: state 53.04 s, compile 26.60 s\n"
           "10:00:09 perf at step 10: tokens_per_sec 1.7e+05, mfu 0.11\n")
    reading = gpu_check.read_train(40)("step 17: test loss 4.1\n", log, 0)
    assert reading.figures == ("Step 1 after 88.56 s: state 53.04 s, compile 26.60 s; "
                               "perf at step 10: tokens_per_sec 1.7e+05, mfu 0.11")
    assert reading.why_not == "the run stopped early, at step 17 of 40"


def test_the_result_file_is_cut_at_one_megabyte(tmp_path):
    huge = gpu_check.Result("big", "ok", 1, 10, "x", "y" * 2_000_000, "")
    gpu_check.write_result(str(tmp_path), [], [huge])
    assert (tmp_path / "gpu-check.md").stat().st_size <= gpu_check.MAX_BYTES


@pytest.mark.slow
def test_the_small_check_on_the_cpu_leaves_one_file_with_a_figure_or_a_reason_for_every_part(tmp_path):
    shim = tmp_path / "bin"  # `python3` is this Python, as on the GPU machine
    shim.mkdir()
    (shim / "python3").write_text(f'#!/bin/sh\nexec {sys.executable} "$@"\n')
    (shim / "python3").chmod(0o755)
    out = tmp_path / "out"
    env = {**os.environ, "PATH": f"{shim}{os.pathsep}{os.environ['PATH']}", "OUT": str(out), "GPU_CHECK_SMALL": "1",
           "GPU_CHECK_DIVERGE": "1"}
    result = subprocess.run(["bash", "benchmarks/gpu.sh", "check"], cwd=ROOT, env=env, capture_output=True,
                            text=True, timeout=600)
    scratch = re.search(r"logs, runs and the trace in (\S+) on that machine", result.stdout)
    if scratch:
        shutil.rmtree(scratch.group(1), ignore_errors=True)
    assert result.returncode == 1, result.stderr[-3000:]  # the bfloat16 transformer diverged, as asked
    assert os.listdir(out) == ["gpu-check.md"] and (out / "gpu-check.md").stat().st_size < 1_000_000
    text = (out / "gpu-check.md").read_text()
    table = text.split("| part | result |")[1].split("\n\n")[0].splitlines()[2:]
    cells = [[cell.strip() for cell in re.split(r"(?<!\\)\|", row)[1:-1]] for row in table]
    rows, figures = {c[0]: c[1] for c in cells}, {c[0]: c[-1] for c in cells}
    assert list(rows) == ["tests", "transformer_f32", "transformer_bf16", "gpt2_small", "profile", "host_cost"]
    assert re.search(r"\d+ passed", figures["tests"])
    assert re.match(r"bare [\d.]+ µs/step; × bare: session", figures["transformer_f32"])
    assert rows["transformer_bf16"] == "failed (exit 1)"
    assert re.search(r"a session stopped: \w+ failed at step \d+: NanLossDuringTrainingError: .*\(in its warm-up",
                     figures["transformer_bf16"])
    assert "Step 1 after" in figures["gpt2_small"] and "perf at step 40" in figures["gpt2_small"]
    assert re.match(r"device [\d.]+ ms/step", figures["profile"]) and "## profile: the top 15 ops" in text
    assert re.match(r"bare_jit [\d.]+ µs/step", figures["host_cost"])
    assert re.search(r"- commit: ([0-9a-f]{40}|unknown)", text) and "- device: JAX " in text
