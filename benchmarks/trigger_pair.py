"""A trigger run of the default set, this checkout against another commit, paired in
one process: the main thread's CPU of each run, both sessions in the same machine state.

`host_cost.py`'s `trigger_cost` runs one tree per process, and on shared cores a whole
process can run slower or faster than the next by more than a change is worth (its
bare call moves between 13 and 30 µs here). This script loads the other commit's
`jaxmon` beside this checkout's, as the package `jaxmon_base` (its `jaxmon/` taken with
`git archive` and its imports of `jaxmon` renamed), builds `host_cost.py`'s default set
(`MonitoredTrainingSession`'s hooks + `LoggingHook(["loss"], every_n_iter=100)` +
`NanHook("loss")`, one step per run) with each, and runs them in alternating blocks of
100 steps (the first block's tree alternates), timing every run with
`time.thread_time()`. Each round is a new process; per round, and as the median of the
rounds:
- `run_on_step_100n`: the run where the step counter, summaries, logging and the NaN
  check act, this checkout's over the other's (median run of each);
- `run_after_it`: the next run, which delivers their late values;
- `quiet_run`: the median of the runs at other places;
- each tree's medians in µs.

Run: .venv/bin/python benchmarks/trigger_pair.py --base a896107 [--rounds 6] [--cycles 30]
"""

from __future__ import annotations

import argparse
import io
import json
import os
import pathlib
import re
import statistics
import subprocess
import sys
import tarfile
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent

#: Imports of `jaxmon` in the other commit's code, renamed to `jaxmon_base`.
_IMPORTS = [(re.compile(r"\bfrom jaxmon([. ])"), r"from jaxmon_base\1"),
            (re.compile(r"\bimport jaxmon\b"), "import jaxmon_base"),
            (re.compile(r"\"jaxmon\."), '"jaxmon_base.'),
            (re.compile(r"\bjaxmon\.(?=[A-Za-z_]+\b)(?!compile\b)"), "jaxmon_base.")]


def unpack_base(commit: str, into: pathlib.Path) -> None:
    """The `jaxmon/` of `commit` as the package `into/jaxmon_base`."""
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", commit, "jaxmon"], check=True,
                             capture_output=True).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(into, filter="data")
    (into / "jaxmon").rename(into / "jaxmon_base")
    for path in (into / "jaxmon_base").rglob("*.py"):
        text = path.read_text()
        for pattern, replacement in _IMPORTS:
            text = pattern.sub(replacement, text)
        path.write_text(text)


def default_sets(base_dir: str, workload: tuple, directory: str) -> dict:
    """The default set's session (`MonitoredTrainingSession`'s hooks + `LoggingHook` and
    `NanHook`, one step per run) on `workload` (init_fn, step_fn, batch), built with the
    base commit's `jaxmon` (unpacked in `base_dir`) and with this checkout's."""
    import itertools

    sys.path.insert(0, base_dir)
    import jaxmon_base
    from rotating import format_logs_into_void

    import jaxmon

    format_logs_into_void()
    init_fn, step_fn, batch = workload

    def session(jm, name):
        hooks = [jm.LoggingHook(["loss"], every_n_iter=100), jm.NanHook("loss")]
        return jm.MonitoredTrainingSession(step_fn, init_fn, checkpoint_dir=os.path.join(directory, name),
                                           save_checkpoint_secs=600, hooks=hooks, data=itertools.repeat(batch))

    return {"base": session(jaxmon_base, "base"), "this": session(jaxmon, "this")}


def run_rounds(script: str, base: str, rounds: int, *args: str) -> list[dict]:
    """`rounds` processes of `script --round BASE_DIR ARGS`, one after the other, with
    `base`'s `jaxmon` unpacked for them; each one's last line of JSON."""
    results = []
    with tempfile.TemporaryDirectory() as base_dir:
        unpack_base(base, pathlib.Path(base_dir))
        for _ in range(rounds):
            out = subprocess.run([sys.executable, script, "--base", base, "--round", base_dir, *args],
                                 check=True, capture_output=True, text=True).stdout
            results.append(json.loads(out.splitlines()[-1]))
    return results


def one_round(base_dir: str, cycles: int, warmup: int) -> dict[str, float]:
    """One process: both trees' sessions, `cycles` blocks of 100 steps each, alternating."""
    import time

    from core_overhead import make_scalar_workload

    runs: dict[str, dict[int, list[float]]] = {"base": {}, "this": {}}
    with tempfile.TemporaryDirectory() as directory:
        sessions = default_sets(base_dir, make_scalar_workload(), directory)
        for sess in sessions.values():
            for _ in range(warmup):
                sess.run()
            sess.sync()
            while sess.step % 100 != 2:
                sess.run()
        for cycle in range(cycles):
            for name in ("base", "this") if cycle % 2 == 0 else ("this", "base"):
                sess, times = sessions[name], runs[name]
                for _ in range(100):
                    place = (sess.step + 1) % 100
                    start = time.thread_time()
                    sess.run()
                    times.setdefault(place, []).append(time.thread_time() - start)
        for sess in sessions.values():
            sess.close()
    medians = {}
    for name, times in runs.items():
        quiet = statistics.median(t for place, ts in times.items() if place not in (0, 1) for t in ts)
        medians[name] = {"quiet_run_us": quiet * 1e6, "run_on_step_100n_us": statistics.median(times[0]) * 1e6,
                         "run_after_it_us": statistics.median(times[1]) * 1e6}
    report = {f"{name}_{key}": round(value, 1) for name, figures in medians.items() for key, value in figures.items()}
    for key in ("run_on_step_100n_us", "run_after_it_us", "quiet_run_us"):
        report[key.removesuffix("_us")] = round(medians["this"][key] / medians["base"][key], 3)
    return report


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--base", required=True, help="the commit to compare with (a896107 and later)")
    parser.add_argument("--rounds", type=int, default=6, help="processes, one after the other")
    parser.add_argument("--cycles", type=int, default=30, help="blocks of 100 steps per tree per round")
    parser.add_argument("--warmup", type=int, default=300)
    parser.add_argument("--round", help=argparse.SUPPRESS)  # a round's process: the unpacked base
    args = parser.parse_args()
    if args.round:
        print(json.dumps(one_round(args.round, args.cycles, args.warmup)))
        return
    rounds = run_rounds(os.path.abspath(__file__), args.base, args.rounds, "--cycles", str(args.cycles),
                        "--warmup", str(args.warmup))
    ratios = {key: round(statistics.median(r[key] for r in rounds), 3)
              for key in ("run_on_step_100n", "run_after_it", "quiet_run")}
    print(json.dumps({"base": args.base, "clock": "time.thread_time() of the main thread", "rounds": rounds,
                      "median_ratio_this_over_base": ratios,
                      "median_us": {key: round(statistics.median(r[key] for r in rounds), 1)
                                    for key in rounds[0] if key.endswith("_us")}}, indent=1))


if __name__ == "__main__":
    main()
