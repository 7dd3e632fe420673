"""The GPU check (`bash benchmarks/gpu.sh check`): the parts below, each under its own
time limit within one budget for the whole check (345 s with its set-up: at most 6
minutes on an H100/H200), the answers wanted most first. Every part ends with its
figures or one line saying why not (its time limit, its last error line, a session
that stopped early, the budget spent before its turn).

Parts: `tests` (the sync-free and compile tests), `transformer_f32` and
`transformer_bf16` (`transformer_overhead.py`: the default set against the bare loop on
a 6 x 512 transformer), `gpt2_small` (a short `jaxmon train --config
configs/gpt2_small.py`: its start-up line and its last perf line), `profile`
(`profile_top_ops.py`: the top ops of gpt2_small's steady steps by device time) and
`host_cost`.

The result is ONE file, `gpu-check.md`, in --out (at most 1 MB: the commit, the device,
the table, the top ops, each part's last lines), rewritten after every part; logs, run
directories and the trace go to --scratch. Exit status 0 when every part gave its
figures, 1 otherwise.

Environment: GPU_CHECK_SMALL=1 tiny models and batches, short timings, the first case of
the first test alone and the top 5 ops (to try the check on a CPU, where the suite runs the
other tests);
GPU_CHECK_DIVERGE=1 the bfloat16 transformer's sessions diverge (a learning rate of 1e6:
the check's own test of a session that stops); GPU_CHECK_BUDGET_S the budget.

Run: python3 benchmarks/gpu_check.py --out DIR --scratch DIR   (gpu.sh check does)
"""

from __future__ import annotations

import argparse
import datetime
import glob
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from typing import NamedTuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULT = "gpu-check.md"
TAIL_LINES, LINE_CHARS, MAX_BYTES = 15, 300, 1_000_000
BUDGET_S = 345  # the whole check's, from its start (the set-up, the device's name, the parts): under 6 minutes
SMALL_BUDGET_S = 900  # with GPU_CHECK_SMALL=1, on a CPU
MIN_PART_S = 15  # a part given less than this is not started


class Reading(NamedTuple):
    """What a part's output says: its figures, or (where none) why not; `extra`: a section of its own."""

    figures: str | None
    why_not: str | None = None
    extra: str = ""


class Part(NamedTuple):
    name: str
    limit_s: float
    argv: list[str]
    read: Callable[[str, str, int | None], Reading]  # (stdout, stderr, exit status) -> Reading


class Result(NamedTuple):
    name: str
    status: str  # "ok", "failed (exit 1)", "time limit", "not run"
    seconds: float
    limit_s: float
    line: str  # the figures, or why not
    extra: str
    tail: str


def run_check(parts: list[Part], budget_s: float, out: str, scratch: str, header: list[str],
              started: float | None = None, min_part_s: float = MIN_PART_S) -> list[Result]:
    """Runs `parts` in order within `budget_s` from `started` (a `time.monotonic()`; default
    now), rewriting `out/gpu-check.md` after each; a part with under `min_part_s` left is not run."""
    started, results = time.monotonic() if started is None else started, []
    env = part_env(scratch)
    for part in parts:
        left = budget_s - (time.monotonic() - started)
        if left < min_part_s:
            results.append(Result(part.name, "not run", 0, part.limit_s, f"not run: {max(left, 0):.0f} s of the "
                                  f"check's {budget_s:.0f} s budget were left", "", ""))
        else:
            print(f"gpu-check: {part.name} (at most {min(part.limit_s, left):.0f} s)", file=sys.stderr, flush=True)
            results.append(run_part(part, min(part.limit_s, left), scratch, env))
            print(f"gpu-check: {part.name}: {results[-1].status}, {results[-1].seconds:.0f} s", file=sys.stderr)
        spent = f"{time.monotonic() - started:.0f} s of its {budget_s:.0f} s budget spent"
        write_result(out, [*header, f"- time: {spent}"], results)
    return results


def part_env(scratch: str) -> dict[str, str]:
    """The parts' environment: this checkout first on PYTHONPATH, JAX's default platforms,
    no GPU memory preallocated, temporary files in `scratch`, output unbuffered."""
    tmp = os.path.join(scratch, "tmp")
    os.makedirs(tmp, exist_ok=True)
    path = os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, "JAX_PLATFORMS": "", "TMPDIR": tmp, "PYTHONUNBUFFERED": "1",
            "XLA_PYTHON_CLIENT_PREALLOCATE": os.environ.get("XLA_PYTHON_CLIENT_PREALLOCATE", "false")}


def run_part(part: Part, limit_s: float, scratch: str, env: dict[str, str]) -> Result:
    """One part in its own process group, killed whole at `limit_s`; its output in `scratch`."""
    out_path, err_path = (os.path.join(scratch, f"{part.name}.{kind}") for kind in ("out", "err"))
    start = time.monotonic()
    with open(out_path, "w") as out, open(err_path, "w") as err:
        try:
            process = subprocess.Popen(part.argv, stdout=out, stderr=err, cwd=ROOT, env=env, start_new_session=True)
        except OSError as error:
            return Result(part.name, "failed", 0, limit_s, f"could not start: {error}", "", "")
        try:
            code: int | None = process.wait(timeout=limit_s)
        except subprocess.TimeoutExpired:
            code = None
            _kill_group(process)
    seconds = time.monotonic() - start
    stdout, stderr = _read_end(out_path), _read_end(err_path)
    try:
        reading = part.read(stdout, stderr, code)
    except Exception as error:  # a reader's bug must not cost the other parts
        reading = Reading(None, f"its output could not be read ({type(error).__name__}: {error})")
    status = "ok" if code == 0 else "time limit" if code is None else f"failed ({_exit(code)})"
    return Result(part.name, status, seconds, limit_s, _line(reading, code, limit_s, stdout, stderr), reading.extra,
                  _tail(stdout, stderr))


def _kill_group(process: subprocess.Popen) -> None:
    try:
        os.killpg(process.pid, signal.SIGKILL)  # at once: the logs are written unbuffered
    except ProcessLookupError:
        pass
    process.wait()


def _read_end(path: str, limit: int = 2_000_000) -> str:
    with open(path, "rb") as file:
        file.seek(max(0, os.path.getsize(path) - limit))
        return file.read().decode(errors="replace")


def _exit(code: int) -> str:
    if code < 0:
        name = signal.Signals(-code).name
        return f"killed by {name}" + (": out of memory?" if name == "SIGKILL" else "")
    return f"exit {code}"


def _line(reading: Reading, code: int | None, limit_s: float, stdout: str, stderr: str) -> str:
    """The figures, or why there are none; a time limit or a failure is said after figures too."""
    if code is None:
        why = f"stopped at its {limit_s:.0f} s time limit; its last line: {last_line(stderr + stdout)}"
    elif code != 0:
        why = reading.why_not or f"{_exit(code)}: {error_line(stderr + stdout)}"
    else:
        why = reading.why_not or (None if reading.figures else f"no figures in its output; its last line: "
                                                                f"{last_line(stderr + stdout)}")
    return "; ".join(filter(None, [reading.figures, why]))


EXCEPTION = re.compile(r"^([\w.]+(Error|Exception|Interrupt|Exit)\b|E +[\w.]+(Error|Exception)\b|FAILED )")
ERROR = re.compile(r"\b(error|Error|ERROR|Killed|Aborted|Segmentation fault|Check failed)\b")


def error_line(text: str) -> str:
    """The last line that reads as an exception (or pytest's failure), else as an error, else the last line."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    for pattern in (EXCEPTION, ERROR):
        for line in reversed(lines):
            if pattern.search(line) and not line.startswith("Traceback"):
                return line[:LINE_CHARS]
    return last_line(text)


def last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1][:LINE_CHARS] if lines else "(no output)"


def _tail(stdout: str, stderr: str) -> str:
    parts = []
    for name, text in (("stderr", stderr), ("stdout", stdout)):
        lines = [line[:LINE_CHARS] for line in text.rstrip().splitlines()[-TAIL_LINES:]]
        if lines:
            parts.append(f"[{name}, last {len(lines)} lines]\n" + "\n".join(lines))
    return "\n".join(parts) or "(no output)"


def write_result(out: str, header: list[str], results: list[Result]) -> str:
    """Writes `out/gpu-check.md` (cut at 1 MB) and returns its text."""
    rows = ["| part | result | seconds | limit | figures, or why not |", "|---|---|---|---|---|"]
    rows += [f"| {r.name} | {r.status} | {r.seconds:.0f} | {r.limit_s:.0f} | {_cell(r.line)} |" for r in results]
    sections = [r.extra for r in results if r.extra]
    tails = [f"### {r.name}: {r.status}, {r.seconds:.0f} s\n\n```\n{r.tail.replace('```', '` ` `')}\n```"
             for r in results if r.tail]
    text = "\n\n".join(["# jaxmon GPU check", "\n".join(header), "\n".join(rows), *sections,
                        "## The parts' last lines", *tails]) + "\n"
    data = text.encode()
    if len(data) > MAX_BYTES:
        data = data[:MAX_BYTES - 100] + b"\n\n(cut at 1 MB)\n"
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, RESULT), "wb") as file:
        file.write(data)
    return data.decode(errors="replace")


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")[:2 * LINE_CHARS]


# What each part's output says.

def read_tests(stdout: str, stderr: str, code: int | None) -> Reading:
    summary = re.findall(r"^=*\s*(\d+ (?:passed|failed|error)[^\n=]*?)\s*=*$", stdout, re.MULTILINE)
    failed = [line.split("::")[-1].split(" - ")[0] for line in stdout.splitlines() if line.startswith("FAILED ")]
    if not summary:
        return Reading(None)
    return Reading(summary[-1] + (f"; failed: {', '.join(failed[:6])}" if failed else ""))


def read_timings(stdout: str, stderr: str, code: int | None) -> Reading:
    """transformer_overhead.py's and host_cost.py's JSON: µs per step and the ratios to the bare loop."""
    report = _json_in(stdout)
    if report is None:
        return Reading(None)
    if "stopped" in report:
        return Reading(None, f"a session stopped: {report['stopped']}")
    us = report["median_us_per_step"]
    ratios = report.get("ratio_to_bare") or report.get("ratio_to_bare_jit")
    bare = next(iter(us))
    figures = f"{bare} {us[bare]} µs/step; × {bare}: " + ", ".join(f"{k} {v}" for k, v in ratios.items() if k != bare)
    if "trigger_cost" in report:  # host_cost.py: the runs where the default set's triggers act
        cost = report["trigger_cost"]
        figures += (f"; the trigger runs {cost['run_on_step_100n_us']} and {cost['run_after_it_us']} µs, a quiet run "
                    f"{cost['quiet_run_in_bare_calls']} bare calls")
    return Reading(figures)


def read_train(steps: int) -> Callable[[str, str, int | None], Reading]:
    def read(stdout: str, stderr: str, code: int | None) -> Reading:
        """`jaxmon train`'s start-up line, its last perf line, and whether it reached its last step."""
        start = re.findall(r"(Step 1 after [\d.]+ s: [^\n]*)", stderr)
        perf = re.findall(r"(perf at step \d+: [^\n]*)", stderr)
        last = re.findall(r"^step (\d+):", stdout, re.MULTILINE)
        figures = "; ".join(start[:1] + perf[-1:]) or None
        if code == 0 and last and int(last[-1]) < steps:
            return Reading(figures, f"the run stopped early, at step {last[-1]} of {steps}")
        return Reading(figures, None if figures or code != 0 else "no start-up or perf line in its log")

    return read


def read_profile(stdout: str, stderr: str, code: int | None) -> Reading:
    report = _json_in(stdout)
    if report is None:
        return Reading(None)
    top = report["top_ops"]
    wall = f" (wall {report['wall_ms_per_step']} ms/step)" if "wall_ms_per_step" in report else ""
    figures = (f"device {report['device_ms_per_step']} ms/step{wall} over {report['ops']} ops; top: "
               + ", ".join(f"{op['op']} {op['percent']}%" for op in top[:3]))
    rows = [f"| {_cell(op['op'])} | {_cell(op['module'])} | {op['ms'] / report['steps']:.3f} | {op['percent']} "
            f"| {op['events']} | {_cell(op['kernel'][:80])} |" for op in top]
    extra = "\n".join([f"## profile: the top {len(top)} ops of {report.get('config', 'the step')} by device time",
                       "", f"{report['steps']} steady steps, {report.get('device', '')}, JAX {report.get('jax', '')}; "
                       f"read from {report['source']}; device {report['device_ms_per_step']} ms/step{wall}.", "",
                       "| op | module | ms/step | % of the device time | events | kernel |",
                       "|---|---|---|---|---|---|", *rows])
    return Reading(figures, extra=extra)


def _json_in(text: str) -> dict | None:
    """The JSON object that ends `text` (a script's report, after any other output)."""
    lines = text.splitlines()
    for i in reversed(range(len(lines))):
        if lines[i].startswith("{"):
            try:
                return json.loads("\n".join(lines[i:]))
            except ValueError:
                continue
    return None


# The parts, the device, the commit.

TESTS = ["tests/metrics/test_accumulators_in_session.py::"
         "test_the_default_set_with_logging_and_nan_checks_dispatches_runs_without_waiting",
         "tests/run/test_quiet_runs.py::test_quiet_runs_of_every_length_and_program_choice_copy_nothing_implicitly",
         "tests/run/test_steps_per_dispatch.py::"
         "test_a_1000_step_run_with_the_usual_hooks_compiles_one_program_per_run_length_at_most",
         "tests/run/test_scan_unroll.py::test_a_run_whose_program_compiles_in_the_background_runs_step_by_step_meanwhile"]
TESTS_SMALL = [TESTS[0] + "[1-auto]"]  # one run length, the CPU's program choice
# Seconds to compile, milliseconds a step; a learning rate for its width (lm.py's 5e-3 is a 64-wide model's).
LM = ["model.num_layers=6", "model.embed_dim=512", "model.mlp_dim=2048", "model.num_heads=8", "model.max_len=256",
      "data.seq_len=256", "data.batch_size=32", "optimizer.learning_rate.peak_value=1e-3"]
LM_SMALL = ["model.num_layers=1", "model.embed_dim=16", "model.mlp_dim=32"]
GPT2_SMALL = ["model.num_layers=1", "model.embed_dim=32", "model.num_heads=2", "model.mlp_dim=64", "data.seq_len=64",
              "model.max_len=64", "data.batch_size=4"]
GPT2_STEPS = 40
DIVERGE = ["optimizer.learning_rate.peak_value=1e6"]
# Each part's time limit on an H100/H200 (seconds; compiles take seconds to tens of seconds there);
# with GPU_CHECK_SMALL=1, on a CPU, SMALL_LIMIT_S each.
LIMITS_S = {"tests": 90, "transformer_f32": 80, "transformer_bf16": 80, "gpt2_small": 150, "profile": 100,
            "host_cost": 45}
SMALL_LIMIT_S = 150


def flags(flag: str, values: list[str]) -> list[str]:
    """`--override a --override b` for flag "--override"; `--config.a --config.b` for "--config."."""
    if flag.endswith("."):
        return [flag + value for value in values]
    return [arg for value in values for arg in (flag, value)]


def parts(scratch: str, small: bool, diverge: bool) -> list[Part]:
    """The check's parts, the answers wanted most first; `small`: tiny models, limits for a CPU."""
    python = sys.executable
    # Small: a warm-up long enough for GPU_CHECK_DIVERGE's NaN to stop a session in it.
    timing = ["--steps", "2", "--cycles", "1", "--warmup", "8"] if small else \
        ["--steps", "30", "--cycles", "6", "--warmup", "40"]
    lm = flags("--override", LM_SMALL if small else LM)
    gpt2 = GPT2_SMALL if small else []
    train = [f"steps={GPT2_STEPS}", f"optimizer.learning_rate.decay_steps={GPT2_STEPS}",
             "optimizer.learning_rate.warmup_steps=10", "perf.every_n_steps=10", *gpt2]
    limits = dict.fromkeys(LIMITS_S, SMALL_LIMIT_S) if small else LIMITS_S
    bf16 = flags("--override", ["model.dtype=bfloat16", *(DIVERGE if diverge else [])])
    return [
        Part("tests", limits["tests"], [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=",
                                        *(TESTS_SMALL if small else TESTS)], read_tests),
        Part("transformer_f32", limits["transformer_f32"],
             [python, "benchmarks/transformer_overhead.py", *timing, *lm], read_timings),
        Part("transformer_bf16", limits["transformer_bf16"],
             [python, "benchmarks/transformer_overhead.py", *timing, *lm, *bf16], read_timings),
        Part("gpt2_small", limits["gpt2_small"],
             [python, "-m", "jaxmon", "train", "--config", "configs/gpt2_small.py", "--workdir",
              os.path.join(scratch, "gpt2_small_run"), *flags("--config.", train)], read_train(GPT2_STEPS)),
        Part("profile", limits["profile"],
             [python, "benchmarks/profile_top_ops.py", "--config", "configs/gpt2_small.py", "--logdir",
              os.path.join(scratch, "profile"), *(["--warmup", "2", "--steps", "3", "--top", "5"] if small else
                                                  ["--warmup", "3", "--steps", "5"]), *flags("--override", gpt2)],
             read_profile),
        Part("host_cost", limits["host_cost"], [python, "benchmarks/host_cost.py", *(
            ["--rounds", "1", "--steps", "200", "--warmup", "50", "--trigger_cycles", "2"] if small else
            ["--rounds", "2", "--steps", "500", "--trigger_cycles", "10"])], read_timings),
    ]


def set_up(scratch: str) -> str:
    """Installs tensorboardX (which the parts need) from .wheels/ where this Python lacks
    it, alone: the other wheels there may be built for another Python. Says what it did."""
    if importlib.util.find_spec("tensorboardX"):
        return "the packages were there"
    wheels = sorted(glob.glob(os.path.join(ROOT, ".wheels", "tensorboard[xX]-*.whl")))
    if not wheels:
        return "tensorboardX is missing and .wheels/ holds no wheel of it: carry .wheels/, filled by `make wheels`"
    with open(os.path.join(scratch, "install.log"), "w") as log:
        try:
            done = subprocess.run([sys.executable, "-m", "pip", "install", "--no-index", "--no-deps", wheels[-1]],
                                  stdout=log, stderr=subprocess.STDOUT, timeout=120)
        except subprocess.TimeoutExpired:
            return "installing tensorboardX took over 120 s (install.log in the scratch directory)"
    if done.returncode:
        return f"installing {os.path.basename(wheels[-1])} failed (install.log in the scratch directory)"
    return f"installed {os.path.basename(wheels[-1])} from .wheels/"


def device() -> str:
    """The GPU as nvidia-smi names it, and what JAX sees."""
    said = []
    if shutil.which("nvidia-smi"):
        said.append(_output(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                            "nvidia-smi") + " (nvidia-smi)")
    probe = ("import jax; d = jax.devices(); print(f'JAX {jax.__version__}: {len(d)} x {d[0].platform} "
             "{d[0].device_kind}')")
    said.append(_output([sys.executable, "-c", probe], "JAX", env={**os.environ, "JAX_PLATFORMS": "",
                                                                   "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}))
    return "; ".join(said)


def commit() -> str:
    head = _output(["git", "rev-parse", "HEAD"], "git")
    if not re.fullmatch(r"[0-9a-f]{40}", head):
        return "unknown (no git checkout)"
    changed = _output(["git", "status", "--porcelain", "--untracked-files=no"], "git")
    return head + (" with uncommitted changes" if changed else "")


def _output(argv: list[str], what: str, env: dict[str, str] | None = None) -> str:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=90, cwd=ROOT, env=env)
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"{what}: {type(error).__name__}"
    if done.returncode:
        return f"{what} failed: {error_line(done.stderr + done.stdout)}"
    return " ".join(done.stdout.split())[:LINE_CHARS]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="where the one result file goes")
    parser.add_argument("--scratch", required=True, help="logs, run directories, the trace")
    args = parser.parse_args()
    started_at = time.monotonic()
    small, diverge = os.environ.get("GPU_CHECK_SMALL") == "1", os.environ.get("GPU_CHECK_DIVERGE") == "1"
    budget = float(os.environ.get("GPU_CHECK_BUDGET_S") or (SMALL_BUDGET_S if small else BUDGET_S))
    started = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    seen = device()
    header = [f"- commit: {commit()}", f"- set-up: {set_up(args.scratch)}", f"- device: {seen}",
              *([] if small or " x gpu " in seen else ["- JAX sees no GPU: the figures below are not a GPU's"]),
              f"- mode: {'GPU_CHECK_SMALL=1, tiny models' if small else 'full'}"
              f"{'; GPU_CHECK_DIVERGE=1: the bfloat16 transformer diverges on purpose' if diverge else ''}",
              f"- started {started}; logs, runs and the trace in {args.scratch} on that machine"]
    results = run_check(parts(args.scratch, small, diverge), budget, args.out, args.scratch, header, started_at)
    with open(os.path.join(args.out, RESULT)) as result:
        print(result.read())
    print(f"gpu-check: the result is {os.path.join(args.out, RESULT)}", file=sys.stderr)
    sys.exit(0 if all(r.status == "ok" for r in results) else 1)


if __name__ == "__main__":
    main()
