"""`jaxmon sweep`: one `jaxmon train` per point of a grid of config values, each in a
workdir of its own, one after another; a rerun trains only the points not finished; it
ends with a table of every point's final metrics (`sweep.json`) and their curves in one
plot (`sweep.png`)."""

from __future__ import annotations

import argparse
import ctypes
import itertools
import json
import os
import re
import signal
import subprocess
import sys
from typing import Any

_DESCRIPTION = """\
Train the config once per point of a grid of values, `jaxmon train` in
WORKDIR/<point> (e.g. WORKDIR/optimizer.learning_rate=0.001,seed=1), one point after
another. --grid KEY=V1,V2,... gives one key's values (give it once per key: the points
are every combination); --config.KEY=VALUE overrides apply to every point. A point whose
run reached its last step is not trained again, so the same command after an
interruption finishes only what was left. At the end: one line per point with its final
metrics (those written at the last step: the final evaluation's), also in
WORKDIR/sweep.json, and every point's curves in WORKDIR/sweep.png (with matplotlib). A
point that fails ends the sweep with its exit code."""


def add_sweep(commands: Any) -> argparse.ArgumentParser:
    """Adds `jaxmon sweep` to `commands` (the main parser's subparsers); returns its parser."""
    sweep = commands.add_parser("sweep", help="train every point of a grid of config values (resumable)",
                                description=_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter,
                                usage="jaxmon sweep --config FILE --workdir DIR --grid KEY=V1,V2 [--grid ...] "
                                      "[--config.KEY=VALUE ...]")
    sweep.add_argument("--config", required=True, metavar="FILE", help="the experiment's config file")
    sweep.add_argument("--workdir", required=True, metavar="DIR", help="the sweep's directory: a run per point")
    sweep.add_argument("--grid", action="append", required=True, metavar="KEY=V1,V2",
                       help="a config key and its values, comma-separated (Python literals or text)")
    sweep.set_defaults(handler=_sweep, takes_overrides=True)
    return sweep


def grid_points(grids: list[str]) -> list[dict[str, str]]:
    """Every combination of the `--grid KEY=V1,V2` values, as `{key: raw value}`, in order."""
    axes = []
    for grid in grids:
        key, equals, values = grid.partition("=")
        raw = [value.strip() for value in values.split(",")]
        if not equals or not key or not all(raw):
            raise ValueError(f"--grid {grid!r}: give a config key and its values, e.g. --grid "
                             "optimizer.learning_rate=0.001,0.003.")
        if key in (k for k, _ in axes):
            raise ValueError(f"--grid {key}= is given twice: give each key once, with all its values.")
        axes.append((key, raw))
    return [dict(zip([key for key, _ in axes], values, strict=True))
            for values in itertools.product(*(raw for _, raw in axes))]


def point_name(point: dict[str, str]) -> str:
    """The point's directory name: `key=value,key=value`, made safe for a file name."""
    return re.sub(r"[^\w.=,+-]", "_", ",".join(f"{key}={value}" for key, value in point.items()))


def _sweep(args: argparse.Namespace) -> int:
    from jaxmon._checkpoints.step_dirs import complete_steps
    from jaxmon._cli.runs import plot_workdirs, run_info
    from jaxmon._experiment.config_file import ConfigError, load_config

    try:
        points = grid_points(args.grid)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    configs = [load_config(args.config, [*args.overrides, *(f"{k}={v}" for k, v in point.items())])
               for point in points]  # every point's config checked before any trains
    os.makedirs(args.workdir, exist_ok=True)
    rows = []
    for i, (point, config) in enumerate(zip(points, configs, strict=True), 1):
        workdir = os.path.join(args.workdir, point_name(point))
        if os.path.isdir(workdir) and complete_steps(workdir)[-1:] == [config.get("steps")]:
            print(f"[{i}/{len(points)}] {point_name(point)}: finished already", flush=True)
        else:
            print(f"[{i}/{len(points)}] {point_name(point)}: training", flush=True)
            command = [sys.executable, "-m", "jaxmon", "train", "--config", args.config, "--workdir", workdir,
                       "--quiet", *args.overrides, *(f"--config.{k}={v}" for k, v in point.items())]
            code = subprocess.run(command, preexec_fn=_die_with_parent).returncode
            if code:
                print(f"jaxmon sweep: the point {point_name(point)} failed with exit code {code} (its output is "
                      "above); the same command trains it and the points after it again.", file=sys.stderr)
                return code
        metrics = run_info(workdir)["metrics"]  # those of the last step: the final evaluation's
        rows.append({"point": point, "workdir": workdir,
                     "metrics": {tag: value for tag, (step, value) in sorted(metrics.items())
                                 if step == config.get("steps") and not tag.startswith("perf/")}})
    with open(os.path.join(args.workdir, "sweep.json"), "w", encoding="utf-8") as f:
        json.dump(rows, f, indent=1)
    _print_table(rows)
    plot_workdirs([row["workdir"] for row in rows], os.path.join(args.workdir, "sweep.png"))
    return 0


def _print_table(rows: list[dict[str, Any]]) -> None:
    keys = list(rows[0]["point"])
    tags = sorted({tag for row in rows for tag in row["metrics"]})
    table = [[*keys, *tags]] + [[*row["point"].values(), *(f"{row['metrics'][tag]:.6g}" if tag in row["metrics"]
                                                             else "-" for tag in tags)] for row in rows]
    widths = [max(len(str(line[c])) for line in table) for c in range(len(table[0]))]
    for line in table:
        print("  ".join(str(cell).ljust(width) for cell, width in zip(line, widths, strict=True)).rstrip())


def _die_with_parent() -> None:
    """In a point's process before it starts: SIGKILL when the sweep's process ends, however
    it ends (Linux; elsewhere the point runs on alone)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
