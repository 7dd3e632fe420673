"""What a `jaxmon` command costs around its work: `--help`, a config's error, `inspect`
and `plot` of a finished run, and short trainings (the default experiment, and the
same with a grain pipeline of 2 workers), each as a user runs it, in a new process.

For each: the wall time, the CPU time (user + sys of the process and its children) and
the seconds from its last line of output to its end. With `--before TREE` (a checkout
of another commit, e.g. `git worktree add /tmp/before COMMIT`), the same commands run
from that tree too, interleaved round by round, with this tree's virtual environment.
Medians of the rounds after the first (which fills the compilation cache).

Run: .venv/bin/python benchmarks/command_cost.py --rounds 5 [--before /tmp/before]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def commands(scratch: str) -> dict[str, list[str]]:
    default = ["train", "--config", "configs/default.py"]
    return {
        "--help": ["--help"],
        "config error": [*default, "--workdir", f"{scratch}/new", "--config.sesion.max_to_keep=2"],
        "inspect": ["inspect", f"{scratch}/done"],
        "plot": ["plot", f"{scratch}/done", "--out", f"{scratch}/plot.png"],
        "train, 50 steps": [*default, "--workdir", f"{scratch}/train", "--config.steps=50"],
        "train, grain, 20 steps": [*default, "--workdir", f"{scratch}/grain", "--config.steps=20",
                                   "--config.data.loader=grain", "--config.data.worker_count=2"],
    }


def once(tree: str, args: list[str], env: dict[str, str], scratch: str) -> tuple[float, float, float]:
    """(wall, CPU, last line to the end) of `python -m jaxmon ARGS` run in `tree`."""
    for name in ("new", "train", "grain"):
        shutil.rmtree(os.path.join(scratch, name), ignore_errors=True)
    before, start = resource.getrusage(resource.RUSAGE_CHILDREN), time.monotonic()
    process = subprocess.Popen([sys.executable, "-m", "jaxmon", *args], cwd=tree, env=env, text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    last = start
    for _ in process.stdout:
        last = time.monotonic()
    process.wait()
    end, after = time.monotonic(), resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    return end - start, cpu, end - last


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--before", help="another checkout to time the same commands in")
    args = parser.parse_args()
    trees = {"before": os.path.abspath(args.before)} if args.before else {}
    trees["after"] = ROOT
    scratch = tempfile.mkdtemp(prefix="command-cost-")
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "JAX_COMPILATION_CACHE_DIR": os.path.join(scratch, "cache"),
           "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}
    subprocess.run([sys.executable, "-m", "jaxmon", "train", "--config", "configs/default.py", "--workdir",
                    f"{scratch}/done", "--config.steps=20"], cwd=ROOT, env=env, capture_output=True, check=True)
    times: dict[str, dict[str, list]] = {tree: {name: [] for name in commands(scratch)} for tree in trees}
    for round_ in range(args.rounds):
        for name, argv in commands(scratch).items():
            for tree in (list(trees) if round_ % 2 == 0 else list(trees)[::-1]):
                times[tree][name].append(once(trees[tree], argv, env, scratch))
    kept = slice(1, None) if args.rounds > 2 else slice(None)
    def medians(runs: list) -> dict[str, float]:
        return {key: round(statistics.median(run[i] for run in runs[kept]), 2)
                for i, key in enumerate(("wall_s", "cpu_s", "tail_s"))}

    result = {tree: {name: medians(runs) for name, runs in by_name.items()} for tree, by_name in times.items()}
    print(json.dumps(result, indent=1))
    shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
