"""How long `jaxmon train` (the `make train` experiment) takes before its first step:
a fresh start, and a restart that resumes from a checkpoint, with and without the
persistent compilation cache that `jaxmon train` keeps in WORKDIR/compilation_cache.

Each round, in a fresh workdir (variants in this order, which each needs):
  1. fresh, no cache:   `--no_compilation_cache`, trains to step 100 (what every start cost before the cache);
  2. fresh, cold cache: a new workdir, trains to step 100 and fills the cache;
  3. restart, no cache: resumes that workdir to step 200 with `--no_compilation_cache`;
  4. restart, cache:    resumes it to step 300 with the cache (what a restart costs now).
"Before the first step" is the wall time from starting the command to the end of the
first run's `after_run` (a probe hook the benchmark adds to the config): Python and
JAX start-up, building the data and the model, restoring, compiling, the first step.
Medians over rounds.

Run: .venv/bin/python benchmarks/restart.py --rounds 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
JAXMON = os.path.join(os.path.dirname(sys.executable), "jaxmon")

PROBE = """\
import time

import jaxmon as jm


class FirstStep(jm.Hook):
    def __init__(self):
        self.done = False

    def after_run(self, ctx, values):
        if not self.done:
            self.done = True
            print("FIRST_STEP", time.time(), flush=True)
"""

CONFIG = """\
import runpy


def get_config():
    config = runpy.run_path({default!r})["get_config"]()
    config["hooks"] = [hook for hook in config["hooks"] if hook["name"] != "ProgressBarHook"]
    config["hooks"].append({{"name": "restart_probe:FirstStep"}})
    return config
"""


def first_step(config: str, workdir: str, steps: int, *extra: str) -> float:
    """Seconds from starting `jaxmon train` to the end of its first run."""
    started = time.time()
    done = subprocess.run([JAXMON, "train", "--config", config, "--workdir", workdir, "--quiet",
                           f"--config.steps={steps}", *extra], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")})
    if done.returncode:
        raise RuntimeError(f"jaxmon train failed ({done.returncode}):\n{done.stderr[-3000:]}")
    [line] = [line for line in done.stdout.splitlines() if line.startswith("FIRST_STEP ")]
    return float(line.split()[1]) - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    times: dict[str, list[float]] = {"fresh, no cache": [], "fresh, cold cache": [], "restart, no cache": [],
                                     "restart, cache": []}
    with tempfile.TemporaryDirectory(prefix="jaxmon-restart-") as tmp:
        with open(os.path.join(tmp, "restart_probe.py"), "w", encoding="utf-8") as file:
            file.write(PROBE)
        config = os.path.join(tmp, "config.py")
        with open(config, "w", encoding="utf-8") as file:
            file.write(textwrap.dedent(CONFIG.format(default=os.path.join(ROOT, "configs", "default.py"))))
        for round_ in range(args.rounds):
            times["fresh, no cache"].append(first_step(config, os.path.join(tmp, f"a{round_}"), 100,
                                                       "--no_compilation_cache"))
            workdir = os.path.join(tmp, f"b{round_}")
            times["fresh, cold cache"].append(first_step(config, workdir, 100))
            times["restart, no cache"].append(first_step(config, workdir, 200, "--no_compilation_cache"))
            times["restart, cache"].append(first_step(config, workdir, 300))
            print(json.dumps({"round": round_, **{k: round(v[-1], 2) for k, v in times.items()}}), file=sys.stderr)
    medians = {name: statistics.median(values) for name, values in times.items()}
    print(json.dumps({"rounds": args.rounds, "median_seconds_before_first_step": {
        name: round(value, 2) for name, value in medians.items()},
        "restart_cache_over_no_cache": round(medians["restart, cache"] / medians["restart, no cache"], 3),
        "per_round": times}, indent=1))


if __name__ == "__main__":
    main()
