"""The GPU check (`benchmarks/gpu_check.py`, `bash benchmarks/gpu.sh check`): every part
ends with its figures or one line saying why not, within the check's budget, and the
result is one file. The small check's runs of `transformer_overhead.py`,
`profile_top_ops.py` and `host_cost.py` are also where those scripts' own output is checked."""

import json
import os
import pathlib
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


@pytest.fixture(scope="module")
def small_check(tmp_path_factory):
    """The small check on this CPU (GPU_CHECK_SMALL=1, its bfloat16 transformer made to
    diverge with GPU_CHECK_DIVERGE=1), run once: the finished process, its --out directory,
    its result file's text, its scratch directory's path and the parts' logs there
    ({"profile.err": text, ...}), read before the scratch directory is removed."""
    tmp_path = tmp_path_factory.mktemp("small_check")
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
    logs = {}
    if scratch:
        logs = {path.name: path.read_text() for path in sorted(pathlib.Path(scratch.group(1)).iterdir())
                if path.suffix in (".out", ".err")}
        shutil.rmtree(scratch.group(1), ignore_errors=True)
    text = (out / "gpu-check.md").read_text() if (out / "gpu-check.md").exists() else ""
    return result, out, text, scratch and scratch.group(1), logs


def table_of(text):
    """The result file's table: ({part: result}, {part: seconds}, {part: figures, or why not})."""
    table = text.split("| part | result |")[1].split("\n\n")[0].splitlines()[2:]
    cells = [[cell.strip() for cell in re.split(r"(?<!\\)\|", row)[1:-1]] for row in table]
    return {c[0]: c[1] for c in cells}, {c[0]: float(c[2]) for c in cells}, {c[0]: c[-1] for c in cells}


@pytest.mark.slow
def test_the_small_check_on_the_cpu_leaves_one_file_with_a_figure_or_a_reason_for_every_part(small_check):
    result, out, text, _, _ = small_check
    assert result.returncode == 1, result.stderr[-3000:]  # the bfloat16 transformer diverged, as asked
    assert os.listdir(out) == ["gpu-check.md"] and (out / "gpu-check.md").stat().st_size < 1_000_000
    rows, _, figures = table_of(text)
    assert list(rows) == ["tests", "transformer_f32", "transformer_bf16", "gpt2_small", "profile", "host_cost"]
    assert re.search(r"\d+ passed", figures["tests"])
    assert re.match(r"bare [\d.]+ µs/step; × bare: session", figures["transformer_f32"])
    assert rows["transformer_bf16"] == "failed (exit 1)"
    assert re.search(r"a session stopped: \w+ failed at step \d+: NanLossDuringTrainingError: .*\(in its warm-up",
                     figures["transformer_bf16"])
    assert "Step 1 after" in figures["gpt2_small"] and "perf at step 40" in figures["gpt2_small"]
    assert re.match(r"device [\d.]+ ms/step", figures["profile"]) and "## profile: the top 5 ops" in text
    assert re.match(r"bare_jit [\d.]+ µs/step", figures["host_cost"])
    assert re.search(r"- commit: ([0-9a-f]{40}|unknown)", text) and "- device: JAX " in text


# What the small check's parts print, as the scripts' own tests: its transformer_f32 part is
# `transformer_overhead.py --steps 2 --cycles 1 --warmup 8` on a 1 x 16 transformer, its
# transformer_bf16 part the same in bfloat16 at a learning rate of 1e6, its profile part
# `profile_top_ops.py --warmup 2 --steps 3 --top 5` on a 1 x 32 gpt2_small, its host_cost
# part `host_cost.py --rounds 1 --steps 200 --warmup 50 --trigger_cycles 2`.

@pytest.mark.slow
def test_transformer_overhead_times_every_loop_on_the_lm_configs_step(small_check):
    _, _, text, _, logs = small_check
    assert table_of(text)[0]["transformer_f32"] == "ok", logs.get("transformer_f32.err", "")[-3000:]
    report = json.loads(logs["transformer_f32.out"])
    assert sorted(report["median_us_per_step"]) == ["bare", "default", "default_k8", "session"]
    assert all(us > 0 for us in report["median_us_per_step"].values()) and report["ratio_to_bare"]["bare"] == 1.0
    assert report["overrides"] == ["model.num_layers=1", "model.embed_dim=16", "model.mlp_dim=32"]


@pytest.mark.slow
def test_transformer_overhead_says_at_once_which_session_diverged_in_its_warm_up_and_why(small_check):
    _, _, text, _, logs = small_check
    rows, seconds, _ = table_of(text)
    assert rows["transformer_bf16"] == "failed (exit 1)", logs.get("transformer_bf16.err", "")[-3000:]
    [line] = logs["transformer_bf16.err"].splitlines()  # one line, no traceback
    stopped = json.loads(logs["transformer_bf16.out"])["stopped"]
    assert line == f"transformer_overhead: {stopped}"
    assert re.match(r"default failed at step 8: NanLossDuringTrainingError: NaN loss during training: 'loss' = nan "
                    r"at step \d+\..*\(in its warm-up of 8 steps\)$", stopped)
    assert seconds["transformer_bf16"] < 120  # ended at once, not at a time limit


@pytest.mark.slow
def test_the_profile_script_traces_steady_steps_of_a_tiny_gpt2(small_check):
    _, _, text, scratch, logs = small_check
    assert table_of(text)[0]["profile"] == "ok", logs.get("profile.err", "")[-3000:]
    report = json.loads(logs["profile.out"])
    assert report["steps"] == 3 and len(report["top_ops"]) == 5 and report["device_ms_per_step"] > 0
    assert all(op["events"] >= 3 for op in report["top_ops"])  # every traced step ran each of them
    assert report["trace"].startswith(os.path.join(scratch, "profile")) and "| op | module |" in logs["profile.err"]


@pytest.mark.slow
def test_host_cost_times_the_main_thread_of_every_variant(small_check):
    _, _, text, _, logs = small_check
    assert table_of(text)[0]["host_cost"] == "ok", logs.get("host_cost.err", "")[-3000:]
    report = json.loads(logs["host_cost.out"])
    variants = ["bare_jit", "session_no_hooks", "mts_default_k1", "mts_default_k32"]
    assert sorted(report["median_us_per_step"]) == sorted(variants)
    assert all(report["median_us_per_run"][name] > 0 for name in variants)
    assert report["steps_per_run"]["mts_default_k1"] == 1.0 and report["steps_per_run"]["mts_default_k32"] > 1.0
    assert report["excess_over_bare_us_per_step"]["bare_jit"] == 0.0
