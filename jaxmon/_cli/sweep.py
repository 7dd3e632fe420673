"""`jaxmon sweep`: one `jaxmon train` per point of a grid, a list or a random draw of
config values, each in a workdir of its own, one after another or several at once; a
rerun trains only the points not finished; it ends with a table of every point's final
metrics (`sweep.json`) and their curves in one plot (`sweep.png`)."""

from __future__ import annotations

import argparse
import ctypes
import itertools
import json
import math
import os
import random
import re
import shlex
import signal
import subprocess
import sys
import time
from typing import Any

_DESCRIPTION = """\
Train the config once per point, `jaxmon train` in WORKDIR/<point> (e.g.
WORKDIR/optimizer.learning_rate=0.001,seed=1). The points, in one of three forms:
  a grid: --grid KEY=V1,V2,... once per key: every combination of the values;
  a list: --point "KEY=V KEY2=V2" once per point (keys and values space-separated);
  random: --random N draws N points, each key's value among its --grid values or
          log-uniformly in a --log-uniform KEY=LOW,HIGH range, from --seed (a rerun
          draws the same points).
--config.KEY=VALUE overrides apply to every point. --parallel N trains N points at
once (each with its share of the GPUs, its output in WORKDIR/<point>/train.log). A
point whose run reached its last step is not trained again, so the same command after
an interruption finishes only what was left. At the end: one line per point with its
final metrics (those written at the last step: the final evaluation's), also in
WORKDIR/sweep.json, and every point's curves in WORKDIR/sweep.png (with matplotlib).
A point that fails ends the sweep (after the points running beside it) with its exit
code."""


def add_sweep(commands: Any) -> argparse.ArgumentParser:
    """Adds `jaxmon sweep` to `commands` (the main parser's subparsers); returns its parser."""
    sweep = commands.add_parser("sweep", help="train every point of a grid, a list or a random draw (resumable)",
                                description=_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter,
                                usage="jaxmon sweep --config FILE --workdir DIR (--grid KEY=V1,V2 ... | --point "
                                      "'KEY=V ...' ... | --random N [--grid ...] [--log-uniform KEY=LOW,HIGH ...]) "
                                      "[--parallel N] [--config.KEY=VALUE ...]")
    sweep.add_argument("--config", required=True, metavar="FILE", help="the experiment's config file")
    sweep.add_argument("--workdir", required=True, metavar="DIR", help="the sweep's directory: a run per point")
    sweep.add_argument("--grid", action="append", default=[], metavar="KEY=V1,V2",
                       help="a config key and its values, comma-separated (Python literals or text)")
    sweep.add_argument("--point", action="append", default=[], metavar="'KEY=V ...'",
                       help="one point: config keys and values, space-separated (give it once per point)")
    sweep.add_argument("--random", type=int, metavar="N", help="draw N points (from --grid values and "
                                                                "--log-uniform ranges)")
    sweep.add_argument("--log-uniform", action="append", default=[], metavar="KEY=LOW,HIGH",
                       help="with --random: a key drawn log-uniformly between LOW and HIGH")
    sweep.add_argument("--seed", type=int, default=None, help="the seed of --random's draws (default 0)")
    sweep.add_argument("--parallel", type=int, default=1, metavar="N", help="train N points at once (default 1)")
    sweep.set_defaults(handler=_sweep, takes_overrides=True)
    return sweep


def grid_points(grids: list[str]) -> list[dict[str, str]]:
    """Every combination of the `--grid KEY=V1,V2` values, as `{key: raw value}`, in order."""
    return _combinations(_axes(grids, "--grid"))


def listed_points(points: list[str]) -> list[dict[str, str]]:
    """The `--point "KEY=V KEY2=V2"` points, as `{key: raw value}`, in order (a value
    with spaces in quotes: `--point "model.features='[16, 32]'"`)."""
    listed: list[dict[str, str]] = []
    for point in points:
        pairs = [pair.partition("=") for pair in shlex.split(point)]
        if not pairs or any(not key or not equals or not value for key, equals, value in pairs):
            raise ValueError(f"--point {point!r}: give config keys and values, space-separated, e.g. --point "
                             "'optimizer.learning_rate=0.001 seed=1'.")
        keys = [key for key, _, _ in pairs]
        twice = sorted({key for key in keys if keys.count(key) > 1})
        if twice:
            raise ValueError(f"--point {point!r} gives {', '.join(twice)} twice: give each key once per point.")
        listed.append({key: value for key, _, value in pairs})
    _check_distinct(listed, "--point options")
    return listed


def random_points(count: int, grids: list[str], log_uniform: list[str], seed: int,
                  ints: frozenset[str] = frozenset()) -> list[dict[str, str]]:
    """`count` points drawn from `seed`: each `--grid` key's value among its values (no
    combination twice before every one was drawn), each `--log-uniform KEY=LOW,HIGH`
    key's log-uniformly between LOW and HIGH (3 significant digits; the keys in `ints`
    rounded to an int). Point i is the same for any `count` above i: a larger draw keeps
    the points of a smaller one."""
    if count < 1:
        raise ValueError(f"--random {count}: give the number of points to draw, at least 1.")
    axes = _axes(grids, "--grid")
    ranges = {}
    for key, bounds in _axes(log_uniform, "--log-uniform").items():
        try:
            low, high = (float(bound) for bound in bounds)
        except ValueError:
            low = high = 0.0
        if not 0 < low < high:
            raise ValueError(f"--log-uniform {key}={','.join(bounds)}: give two positive numbers LOW,HIGH with LOW "
                             "< HIGH, e.g. --log-uniform optimizer.learning_rate=1e-4,1e-2.")
        ranges[key] = (low, high)
    if set(axes) & set(ranges):
        raise ValueError(f"--grid and --log-uniform both give {', '.join(sorted(set(axes) & set(ranges)))}: give "
                         "each key once.")
    if not axes and not ranges:
        raise ValueError("--random draws from --grid values and --log-uniform ranges: give at least one.")
    combinations = _combinations(axes)
    if not ranges and count > len(combinations):
        raise ValueError(f"--random {count}: the grid has only {len(combinations)} points; draw at most that many.")
    order, shuffler = [], random.Random(f"{seed}/grid")  # seeded by text: the same in every process
    while len(order) < count:
        cycle = list(combinations)
        shuffler.shuffle(cycle)
        order.extend(cycle)
    points: list[dict[str, str]] = []
    for i in range(count):
        for attempt in range(100):  # a value rounded to one drawn before: draw again
            draw = random.Random(f"{seed}/{i}/{attempt}")
            point = {**order[i], **{key: _log_uniform(draw, low, high, key in ints)
                                    for key, (low, high) in ranges.items()}}
            if point_name(point) not in (point_name(p) for p in points):
                break
        else:
            raise ValueError(f"--random {count}: the ranges give fewer than {count} different points once rounded; "
                             "draw fewer, or widen the ranges.")
        points.append(point)
    return points


def _log_uniform(draw: random.Random, low: float, high: float, whole: bool) -> str:
    """A value drawn log-uniformly in [low, high], as text: an int, or 3 significant digits."""
    value = math.exp(draw.uniform(math.log(low), math.log(high)))
    if whole:
        return str(min(max(round(value), math.ceil(low)), math.floor(high)))
    text = f"{value:.3g}"
    return text if low <= float(text) <= high else repr(value)


def _combinations(axes: dict[str, list[str]]) -> list[dict[str, str]]:
    return [dict(zip(axes, values, strict=True)) for values in itertools.product(*axes.values())]


def _axes(options: list[str], flag: str) -> dict[str, list[str]]:
    """`{key: [raw values]}` from `KEY=V1,V2` options."""
    axes: dict[str, list[str]] = {}
    for option in options:
        key, equals, values = option.partition("=")
        raw = [value.strip() for value in values.split(",")]
        if not equals or not key or not all(raw):
            raise ValueError(f"{flag} {option!r}: give a config key and its values, e.g. {flag} "
                             "optimizer.learning_rate=0.001,0.003.")
        if key in axes:
            raise ValueError(f"{flag} {key}= is given twice: give each key once, with all its values.")
        twice = sorted({value for value in raw if raw.count(value) > 1})
        if twice:
            raise ValueError(f"{flag} {option!r} gives {', '.join(twice)} twice: give each value once.")
        axes[key] = raw
    return axes


def _check_distinct(points: list[dict[str, str]], given: str) -> None:
    names = [point_name(point) for point in points]
    twice = sorted({name for name in names if names.count(name) > 1})
    if twice:
        raise ValueError(f"two {given} give the point {twice[0]}: give each point once.")


def sweep_points(args: argparse.Namespace, ints: frozenset[str] = frozenset()) -> list[dict[str, str]]:
    """The points the options give (one form of the three); `ints`: the config keys
    whose values are ints (a `--log-uniform` draw of one is rounded)."""
    if args.random is not None:
        if args.point:
            raise ValueError("--point lists points and --random draws them: give one of the two.")
        return random_points(args.random, args.grid, args.log_uniform, 0 if args.seed is None else args.seed, ints)
    if args.log_uniform or args.seed is not None:
        raise ValueError(f"{'--log-uniform' if args.log_uniform else '--seed'} is for random draws: add --random N.")
    if args.point and args.grid:
        raise ValueError("--grid makes every combination and --point lists points: give one of the two.")
    if not args.point and not args.grid:
        raise ValueError("give the points: --grid KEY=V1,V2, --point 'KEY=V ...' or --random N.")
    return listed_points(args.point) if args.point else grid_points(args.grid)


def point_name(point: dict[str, str]) -> str:
    """The point's directory name: `key=value,key=value`, made safe for a file name."""
    return re.sub(r"[^\w.=,+-]", "_", ",".join(f"{key}={value}" for key, value in point.items()))


def _sweep(args: argparse.Namespace) -> int:
    from jaxmon._base.errors import ConfigError
    from jaxmon._checkpoints.step_dirs import complete_steps
    from jaxmon._cli.runs import plot_workdirs, run_info
    from jaxmon._experiment.config_file import load_config
    from jaxmon._experiment.keys import check_top_level

    base = load_config(args.config, args.overrides)
    check_top_level(base)
    try:
        if args.parallel < 1:
            raise ValueError(f"--parallel {args.parallel}: give how many points train at once, at least 1.")
        points = sweep_points(args, ints=_int_keys(base, [option.partition("=")[0] for option in args.log_uniform]))
        shares = device_shares(args.parallel, _visible_gpus() if args.parallel > 1 else [])
    except ValueError as error:
        raise ConfigError(str(error)) from None
    configs = [load_config(args.config, [*args.overrides, *(f"{k}={v}" for k, v in point.items())])
               for point in points]  # every point's config checked before any trains
    os.makedirs(args.workdir, exist_ok=True)
    workdirs = [os.path.join(args.workdir, point_name(point)) for point in points]
    todo = []
    for i, (point, config, workdir) in enumerate(zip(points, configs, workdirs, strict=True), 1):
        if os.path.isdir(workdir) and complete_steps(workdir)[-1:] == [config.get("steps")]:
            print(f"[{i}/{len(points)}] {point_name(point)}: finished already", flush=True)
        else:
            todo.append((i, point, workdir))
    code = _train(args, todo, len(points), shares)
    if code:
        return code
    rows = []
    for point, config, workdir in zip(points, configs, workdirs, strict=True):
        metrics = run_info(workdir)["metrics"]  # those of the last step: the final evaluation's
        rows.append({"point": point, "workdir": workdir,
                     "metrics": {tag: value for tag, (step, value) in sorted(metrics.items())
                                 if step == config.get("steps") and not tag.startswith("perf/")}})
    with open(os.path.join(args.workdir, "sweep.json"), "w", encoding="utf-8") as f:
        json.dump(rows, f, indent=1)
    _print_table(rows)
    plot_workdirs([row["workdir"] for row in rows], os.path.join(args.workdir, "sweep.png"))
    return 0


def _train(args: argparse.Namespace, todo: list[tuple[int, dict[str, str], str]], count: int,
           shares: list[str | None]) -> int:
    """Trains the points of `todo` (`(number, point, workdir)`), `args.parallel` at once,
    slot s with the GPUs `shares[s]`; the first failure's exit code (0: none), once the
    points running beside it ended."""
    running: dict[int, tuple[subprocess.Popen, dict[str, str], Any]] = {}  # by share
    failed = 0
    queue = list(todo)
    while running or (queue and not failed):
        while queue and not failed and len(running) < args.parallel:
            i, point, workdir = queue.pop(0)
            share = next(s for s in range(args.parallel) if s not in running)
            command = [sys.executable, "-m", "jaxmon", "train", "--config", args.config, "--workdir", workdir,
                       "--quiet", *args.overrides, *(f"--config.{k}={v}" for k, v in point.items())]
            env, log = dict(os.environ), None
            if shares[share] is not None:
                env["CUDA_VISIBLE_DEVICES"] = shares[share]
            if args.parallel > 1:
                os.makedirs(workdir, exist_ok=True)
                log = open(os.path.join(workdir, "train.log"), "a", encoding="utf-8")  # closed when it ends
            print(f"[{i}/{count}] {point_name(point)}: training"
                  + (f" (output in {os.path.join(workdir, 'train.log')})" if log else ""), flush=True)
            process = subprocess.Popen(command, env=env, stdout=log, stderr=log, preexec_fn=_die_with_parent)
            running[share] = (process, point, log)
        share = _wait_any({s: process for s, (process, _, _) in running.items()})
        process, point, log = running.pop(share)
        if log is not None:
            log.close()
        if process.returncode and not failed:
            failed = process.returncode if process.returncode > 0 else 128 - process.returncode  # killed by signal N
            where = "in its train.log" if log is not None else "above"
            print(f"jaxmon sweep: the point {point_name(point)} failed with exit code {failed} (its output is "
                  f"{where}); the same command trains it and the points not finished again.", file=sys.stderr)
    return failed


def device_shares(parallel: int, gpus: list[str]) -> list[str | None]:
    """Each of `parallel` slots' `CUDA_VISIBLE_DEVICES` (None: left as it is): with several
    points at once and `gpus` (the ids this process may use), each slot its own
    `len(gpus) // parallel` of them."""
    if parallel == 1 or not gpus:
        return [None] * parallel
    if parallel > len(gpus):
        raise ValueError(f"--parallel {parallel}: this machine has {len(gpus)} GPUs, and points at once do not share "
                         f"one; give --parallel {len(gpus)} or fewer.")
    per = len(gpus) // parallel
    return [",".join(gpus[s * per:(s + 1) * per]) for s in range(parallel)]


def _visible_gpus() -> list[str]:
    """The ids of the GPUs this process may use (`CUDA_VISIBLE_DEVICES`, else those
    `nvidia-smi -L` lists), without JAX."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return [gpu.strip() for gpu in visible.split(",") if gpu.strip()]
    try:
        listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [str(i) for i, line in enumerate(line for line in listed.splitlines() if line.startswith("GPU "))]


def _int_keys(config: dict[str, Any], keys: list[str]) -> frozenset[str]:
    """Those of the dotted `keys` whose value in `config` is an int (an unknown key: a
    `ConfigError` naming the nearest known one)."""
    from jaxmon._experiment.config_file import value_at

    return frozenset(key for key in keys if type(value_at(config, key)) is int)


def _wait_any(processes: dict[int, subprocess.Popen]) -> int:
    """The key of a process of `processes` that has ended (waits for one)."""
    while True:
        for key, process in processes.items():
            if process.poll() is not None:
                return key
        time.sleep(0.1)


def _print_table(rows: list[dict[str, Any]]) -> None:
    keys = list(dict.fromkeys(key for row in rows for key in row["point"]))  # listed points may differ in keys
    tags = sorted({tag for row in rows for tag in row["metrics"]})
    table = [[*keys, *tags]] + [[*(row["point"].get(key, "-") for key in keys),
                                 *(f"{row['metrics'][tag]:.6g}" if tag in row["metrics"] else "-" for tag in tags)]
                                for row in rows]
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
