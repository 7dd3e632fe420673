"""Where a fresh `jaxmon train` spends the seconds before its first step, part by part,
as its start-up line says (`docs/cli.md`, "The start-up line"): a fresh run directory
each round (no compilation cache to find), the run ended once it has logged the line. With --tree,
the run uses another checkout's jaxmon (a worktree of a base commit, on PYTHONPATH), so
two trees compare on one machine, rounds alternating when several --tree are given.

Run: .venv/bin/python benchmarks/startup.py --config configs/gpt2_small.py --rounds 3 \
       --override data.batch_size=1 [--tree /path/to/base --tree .]
Prints JSON: each tree's start-up parts, the median of the rounds, in seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LINE = re.compile(r"Step 1 after ([\d.]+) s: (.*)\.")
PART = re.compile(r"([a-z0-9 -]+?) ([\d.]+) s(?:, |$)")


def start_up(tree: str, config: str, overrides: list[str]) -> dict[str, float]:
    """One fresh run from `tree`, ended once it has logged its start-up line: the line's
    parts and total, in seconds."""
    with tempfile.TemporaryDirectory() as workdir:
        env = {**os.environ, "PYTHONPATH": os.path.abspath(tree)}
        command = [sys.executable, "-m", "jaxmon", "train", "--config", config, "--workdir", workdir,
                   *(f"--config.{override}" for override in overrides)]
        process = subprocess.Popen(command, cwd=tree, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                   text=True)
        seen, found = [], None
        try:
            for line in process.stdout:
                seen.append(line)
                found = LINE.search(line)
                if found is not None:
                    break
        finally:
            process.kill()  # the line is all this wants: no evaluation, no save
            process.wait()
    if found is None:
        raise RuntimeError(f"no start-up line from {tree} (exit {process.returncode}):\n{''.join(seen)[-3000:]}")
    parts = {"total": float(found.group(1))}
    for name, seconds in PART.findall(found.group(2)):
        parts[name] = float(seconds)
    return parts


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", default="configs/gpt2_small.py")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--override", action="append", default=[], help="KEY=VALUE, as --config.KEY=VALUE")
    parser.add_argument("--tree", action="append", default=[], help="a checkout to run (default: this one)")
    args = parser.parse_args()
    trees = args.tree or [ROOT]
    rounds: dict[str, list[dict[str, float]]] = {tree: [] for tree in trees}
    for _ in range(args.rounds):
        for tree in trees:
            rounds[tree].append(start_up(tree, args.config, args.override))
    report = {tree: {part: round(statistics.median(r[part] for r in runs), 2) for part in runs[0]}
              for tree, runs in rounds.items()}
    print(json.dumps({"config": args.config, "overrides": args.override, "rounds": args.rounds,
                      "median_seconds": report}, indent=1))


if __name__ == "__main__":
    main()
