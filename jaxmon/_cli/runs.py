"""`jaxmon inspect` and `jaxmon plot`: what a run's directory holds, and its curves."""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import math
import os
import sys
import textwrap
from collections.abc import Mapping
from typing import Any, NamedTuple

from jaxmon._base.paths import size_text


def add_inspect(commands: Any) -> argparse.ArgumentParser:
    """Adds `jaxmon inspect` to `commands` (the main parser's subparsers); returns its parser."""
    inspect = commands.add_parser("inspect", help="a run's checkpoints, latest metrics and config",
                                  description="List a run's checkpoints (step, size, time, sealed by an integrity "
                                              "manifest or not; with a saver's keep_best, each one's "
                                              "best_metric and the best marked), its "
                                              "latest metrics and the config it was trained with. A line of "
                                              "metrics.jsonl that is no JSON record (a killed writer's last, "
                                              "bytes that are not text) is skipped with a note naming it; "
                                              "characters that would control the terminal are printed escaped "
                                              "(\\x1b). A directory that holds no checkpoint, metrics.jsonl, "
                                              "event file or hparams.json is not a run (exit 2).")
    inspect.add_argument("workdir", metavar="DIR")
    inspect.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    inspect.add_argument("--verify", action="store_true",
                         help="re-read every file of every checkpoint against its integrity manifest: one line per "
                              "checkpoint (sound, changed, unsealed, or broken: a step's directory empty or "
                              "partial); exit 1 unless every one is sound")
    inspect.set_defaults(handler=_inspect)
    return inspect


def add_plot(commands: Any) -> argparse.ArgumentParser:
    """Adds `jaxmon plot` to `commands` (the main parser's subparsers); returns its parser."""
    plot = commands.add_parser("plot", help="PNG curves of runs' scalar summaries (needs matplotlib)",
                               description="Plot every scalar of each DIR/metrics.jsonl against the step into "
                                           "one PNG: a run's train and eval values of a metric (loss, eval/loss) "
                                           "on shared axes, several runs overlaid with a legend (matplotlib: "
                                           "pip install 'jaxmon[plot]').")
    plot.add_argument("workdirs", nargs="+", metavar="DIR")
    plot.add_argument("--out", metavar="PNG",
                      help="the image to write (.png added to a name without an extension; in a directory, "
                           "<run>.png; default DIR/metrics.png, or ./metrics.png for several runs)")
    plot.add_argument("--tags", nargs="+", metavar="TAG", help="only these scalars")
    plot.set_defaults(handler=_plot)
    return plot


def _inspect(args: argparse.Namespace) -> int:
    if args.verify:
        return _verify(args.workdir, args.json)
    info = run_info(args.workdir)
    if args.json:
        print(json.dumps(info, indent=2, default=str))
        return 0
    print(f"run {shown(info['workdir'])}")
    if info["checkpoints"]:
        print(f"checkpoints ({len(info['checkpoints'])}):")
        for item in info["checkpoints"]:
            best = "" if item["best_metric"] is None else f"  best_metric {item['best_metric']:.6g}"
            mark = {None: "", 1: "  (best)"}.get(item["best_rank"], f"  (#{item['best_rank']})")
            print(f"  step {item['step']:>8}  {size_text(item['bytes']):>9}  {shown(item['time'])}  "
                  f"{'sealed' if item['sealed'] else 'unsealed'}{best}{mark}")
    else:
        print("checkpoints: none")
    if info["metrics"]:
        print("latest metrics:")
        width = max(len(shown(tag)) for tag in info["metrics"])
        for tag, (step, value) in sorted(info["metrics"].items()):
            print(f"  {shown(tag):<{width}}  {value:.6g}  (step {step})")
    else:
        there = os.path.isfile(os.path.join(info["workdir"], "metrics.jsonl"))
        print(f"latest metrics: none ({'no scalar in metrics.jsonl' if there else 'no metrics.jsonl'})")
    _print_goodput(info["goodput"])
    if info["config"] is not None:
        print("config:")
        for line in json.dumps(info["config"], indent=2, sort_keys=True, default=str).splitlines():
            print(f"  {line}")  # JSON: control characters are escaped (\u001b)
    else:
        print("config: none saved")
    return 0


def _verify(workdir: str, as_json: bool) -> int:
    """`jaxmon inspect --verify`: every checkpoint re-read against its manifest, and every
    step's directory that holds no complete checkpoint named broken; 1 unless all are sound."""
    from jaxmon._checkpoints import integrity
    from jaxmon._checkpoints.step_dirs import is_complete, step_directories

    check_run(workdir)
    first = integrity.sealed_from(workdir)  # once: it lists the run's step directories
    results = []
    for step in step_directories(workdir):
        path = os.path.join(workdir, str(step))
        if is_complete(path):
            state, what = integrity.verify(path, first is not None and step >= first)
        else:
            state, what = "broken", _incomplete(path)
        results.append({"step": step, "state": state, "what": what})
    if as_json:
        print(json.dumps({"workdir": workdir, "checkpoints": results}, indent=2))
    else:
        print(f"run {shown(workdir)}: {len(results)} checkpoint{'s' if len(results) != 1 else ''} re-read")
        for result in results:
            print(f"  step {result['step']:>8}  {result['state']:<8}  {shown(result['what'])}")
    return 0 if results and all(result["state"] == "sound" for result in results) else 1


def _incomplete(step_directory: str) -> str:
    """What `--verify` says of a step's directory that holds no complete checkpoint."""
    from jaxmon._checkpoints.integrity import MANIFEST
    from jaxmon._checkpoints.step_dirs import COMMIT_MARKER

    files = sum(len(names) for _, _, names in os.walk(step_directory))
    what = "empty directory" if files == 0 else (f"partial directory ({files} file{'s' if files != 1 else ''}, "
                                                 f"neither {COMMIT_MARKER} nor {MANIFEST})")
    return (f"{what}, no checkpoint: a restore skips it. Put its files back from a copy, or remove "
            f"{step_directory} (that step is lost)")


def _print_goodput(goodput: dict[str, Any] | None) -> None:
    if goodput is None:
        print("goodput: none recorded (no goodput.json: jm.GoodputHook writes it)")
        return
    seconds = goodput["seconds"]
    wall = sum(seconds.values())
    share = (lambda secs: secs / wall) if wall > 0 else (lambda secs: 0.0)
    processes = goodput["processes"]
    print(f"goodput: {share(seconds.get('productive', 0.0)):.1%} productive of {wall:.1f} s, over the run's whole "
          f"life ({processes} process{'es' if processes != 1 else ''}, one after the other):")
    for category, secs in seconds.items():
        print(f"  {shown(category):<11} {secs:10.2f} s  {share(secs):6.1%}")


def run_info(workdir: str) -> dict[str, Any]:
    """What `jaxmon inspect` shows, as a dict: checkpoints (step, bytes, time, whether a
    manifest seals it; with `keep_best`, the `best_metric` ranked: `best_rank` 1 is the best), the latest value of
    each scalar in metrics.jsonl, and the latest checkpoint's config."""
    from jaxmon._checkpoints.integrity import MANIFEST
    from jaxmon._checkpoints.step_dirs import complete_steps, disk_bytes, read_meta

    check_run(workdir)
    checkpoints = []
    for step in complete_steps(workdir):
        path = os.path.join(workdir, str(step))
        meta = read_meta(path) or {}
        when = meta.get("time") or datetime.datetime.fromtimestamp(os.path.getmtime(path)).astimezone().isoformat(
            timespec="seconds")
        checkpoints.append({"step": step, "bytes": disk_bytes(path), "time": when, **_best_metric(path),
                            "sealed": os.path.isfile(os.path.join(path, MANIFEST))})
    _rank_best(checkpoints)
    metrics: dict[str, tuple[int, float]] = {}
    parts = metric_parts(workdir)
    for record in records(os.path.join(workdir, "metrics.jsonl")):
        for tag, value in record.items():
            if (tag not in ("step", "wall_time") and not tag.startswith("goodput/") and tag not in parts
                    and _is_number(value) and math.isfinite(value)):  # goodput has its own section
                metrics[tag] = (record["step"], value)
    config = None
    if checkpoints:
        config = (read_meta(os.path.join(workdir, str(checkpoints[-1]["step"]))) or {}).get("config")
    return {"workdir": workdir, "checkpoints": checkpoints, "metrics": metrics, "config": config,
            "goodput": goodput_of(workdir)}


def goodput_of(workdir: str) -> dict[str, Any] | None:
    """The run's seconds by category over its whole life, from `goodput.json` (written by
    `jm.GoodputHook`): `{"processes": n, "seconds": {category: secs}}`; None without it."""
    from jaxmon._ops.time_spent import FILE, read_record, recorded_seconds

    try:
        record = read_record(os.path.join(workdir, FILE))
        if record is None:
            return None
        return {"processes": int(record.get("processes", 1)), "seconds": recorded_seconds(record)}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def _best_metric(path: str) -> dict[str, Any]:
    """A checkpoint's `best_metric` and its `best_mode`, as Orbax's CheckpointManager keeps them
    (`STEP/metrics/metrics`, JSON `{"best": value, "mode": "min" or "max"}`); None if absent."""
    try:
        with open(os.path.join(path, "metrics", "metrics")) as file:
            metrics = json.load(file)
    except (OSError, ValueError):
        metrics = None
    value = metrics.get("best") if isinstance(metrics, dict) else None
    mode = metrics.get("mode") if _is_number(value) else None
    return {"best_metric": value if _is_number(value) else None, "best_mode": mode, "best_rank": None}


def _rank_best(checkpoints: list[dict[str, Any]]) -> None:
    """Sets each ranked checkpoint's `best_rank`: 1 for the best (ties share a rank)."""
    ranked = [c for c in checkpoints if c["best_metric"] is not None and c["best_mode"] in ("min", "max")]
    for item in ranked:
        sign = 1 if item["best_mode"] == "min" else -1
        item["best_rank"] = 1 + sum(sign * c["best_metric"] < sign * item["best_metric"] for c in ranked)


def plot_workdirs(workdirs: list[str], out: str) -> int:
    """`jaxmon plot WORKDIRS --out OUT` (one line says what it wrote, or why not); its exit code."""
    return _plot(argparse.Namespace(workdirs=list(workdirs), out=out, tags=None))


def _plot(args: argparse.Namespace) -> int:
    try:
        plt = _pyplot()
    except ImportError:
        print("jaxmon plot needs matplotlib: pip install 'jaxmon[plot]' (or pip install matplotlib).",
              file=sys.stderr)
        return 2
    runs = {}  # each run's label: {tag: (steps, values)}
    workdirs = _plottable(args.workdirs)
    for workdir in workdirs:
        path = os.path.join(workdir, "metrics.jsonl")
        if not os.path.isfile(path):
            why = ("a directory that is not a jaxmon run (no checkpoint, TensorBoard event file or hparams.json "
                   "either): pass the --workdir of a `jaxmon train` run" if os.path.isdir(workdir) and not is_run(
                       workdir) else "summaries of a run go there (SummarySaverHook / MonitoredTrainingSession "
                                     "with a checkpoint or summary dir)")
            print(f"jaxmon plot: no metrics.jsonl in {workdir!r}, {why}.", file=sys.stderr)
            return 2
        series = read_series(path, goodput=bool(args.tags))  # asked for by name, the goodput seconds too
        if not args.tags:  # the sums a metric divides, unless asked for by name
            parts = metric_parts(workdir)
            series = {tag: values for tag, values in series.items() if tag not in parts}
        if args.tags:
            missing = sorted(set(args.tags) - set(series))
            if missing:
                print(f"jaxmon plot: no scalar {missing[0]!r} in {shown(path)}; it has "
                      f"{shown(', '.join(sorted(series)))}.", file=sys.stderr)
                return 2
            series = {tag: series[tag] for tag in args.tags}
        if not series:
            print(f"jaxmon plot: {shown(path)} holds no scalars.", file=sys.stderr)
            return 2
        runs[_run_label(workdir, runs)] = series
    tags = sorted({tag for series in runs.values() for tag in series})
    out = _out_path(args.out, workdirs)
    figure = draw(plot_plan(runs), ", ".join(os.path.abspath(workdir) for workdir in workdirs))
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    from jaxmon._base.paths import LinkedFileError, open_file

    try:  # the default, DIR/metrics.png, is a file of the run's directory: never written through a link
        with open(out, "wb") if args.out else open_file(out, "wb") as file:
            figure.savefig(file, dpi=100, format=os.path.splitext(out)[1][1:].lower())
    except LinkedFileError as error:
        raise _given_wrong(f"{error} Or give --out another file.") from None
    finally:
        plt.close(figure)
    several = f"{len(runs)} runs, " if len(runs) > 1 else ""
    print(f"wrote {shown(out)} ({several}{len(tags)} scalars: {shown(', '.join(tags))})")
    return 0


def _plottable(paths: list[str]) -> list[str]:
    """Of several `paths` (a shell's `runs/sweep/*`), the directories with a metrics.jsonl,
    the others skipped in one line (a sweep's sweep.json and sweep.png, say); one path, or
    none plottable among several: all of them, for the error that names the first."""
    kept = [path for path in paths if os.path.isfile(os.path.join(path, "metrics.jsonl"))]
    if len(paths) < 2 or not kept:
        return list(paths)
    skipped = [path for path in paths if path not in kept]
    if skipped:
        print(f"jaxmon plot: skipped {len(skipped)} path(s) with no metrics.jsonl: "
              f"{shown(', '.join(skipped))}.", file=sys.stderr)
    return kept


def _out_path(out: str | None, workdirs: list[str]) -> str:
    """The file `jaxmon plot` writes: `--out`, with ".png" added when it has no extension,
    or in the directory it names `<run>.png` (`metrics.png` for several runs); without
    `--out`, DIR/metrics.png (./metrics.png for several runs).

    Raises:
      ConfigError: `--out` has an extension matplotlib cannot write.
    """
    if out is None:
        return os.path.join(workdirs[0] if len(workdirs) == 1 else ".", "metrics.png")
    if os.path.isdir(out):
        name = os.path.basename(os.path.abspath(workdirs[0])) if len(workdirs) == 1 else ""
        return os.path.join(out, f"{name or 'metrics'}.png")
    extension = os.path.splitext(out)[1][1:].lower()
    if not extension:
        return f"{out}.png"
    from matplotlib.backend_bases import FigureCanvasBase

    if extension not in FigureCanvasBase.get_supported_filetypes():
        types = ", ".join(sorted(FigureCanvasBase.get_supported_filetypes()))
        raise _given_wrong(f"--out {out!r}: matplotlib cannot write .{extension} files; give a name ending in one "
                           f"of {types} (or a directory, to write <run>.png in it).")
    return out


def metric_parts(workdir: str) -> tuple[str, ...]:
    """The tags of `workdir`'s records that are the sums its task's metrics divide
    (`keys.TASK_PARTS`: the lm task's `loss_sum`, `tokens`, `correct`), from its
    hparams.json; () for another task or a run without one."""
    from jaxmon._experiment.keys import TASK_PARTS

    try:
        with open(os.path.join(workdir, "hparams.json"), encoding="utf-8") as f:
            task = json.load(f).get("task")
    except (OSError, ValueError, AttributeError):
        return ()
    return TASK_PARTS.get(task, ()) if isinstance(task, str) else ()


def read_series(path: str, goodput: bool = False) -> dict[str, tuple[list[int], list[float]]]:
    """Every scalar of a metrics.jsonl: `{tag: (steps, values)}`; the `goodput/*` seconds
    only with `goodput` (`jaxmon inspect` shows them as a table)."""
    series: dict[str, tuple[list[int], list[float]]] = {}
    for record in records(path):
        for tag, value in record.items():
            if tag not in ("step", "wall_time") and _is_number(value) and (goodput or not tag.startswith("goodput/")):
                steps, values = series.setdefault(tag, ([], []))
                steps.append(record["step"])
                values.append(value)
    return series


class Line(NamedTuple):
    """One curve of a panel: `eval` marks an evaluation's values (dashed, with markers)."""

    label: str
    steps: list[int]
    values: list[float]
    color: str
    eval: bool


class Panel(NamedTuple):
    """One metric's axes: its train and eval curves, on a "linear" or "log" `yscale`."""

    title: str
    yscale: str
    lines: tuple[Line, ...]


def plot_plan(runs: Mapping[str, Mapping[str, tuple[list[int], list[float]]]]) -> list[Panel]:
    """What `jaxmon plot` draws of `runs` (`{label: {tag: (steps, values)}}`): one panel per
    metric, sorted, its eval values ("eval/loss", or any "PREFIX/loss" beside "loss") on
    the axes of its train values; a log y axis where the positive values span more than
    two decades. Eval curves are dashed, with markers; one run's train is blue and its eval
    orange, several runs take a colour each."""
    grouped: dict[str, list[Line]] = {}
    for i, (label, series) in enumerate(runs.items()):
        evals = {tag: tag.partition("/")[2] in series or tag.startswith("eval/") for tag in series}
        for tag in sorted(series, key=lambda tag: (evals[tag], tag)):  # train first, eval drawn over it
            rest, is_eval = tag.partition("/")[2], evals[tag]
            paired = rest in series
            color = ("C1" if is_eval else "C0") if len(runs) == 1 else f"C{i % 10}"
            name = tag if len(runs) == 1 else f"{label}: {tag}"
            grouped.setdefault(rest if paired else tag, []).append(Line(name, *series[tag], color, is_eval))
    return [Panel(title, _yscale(lines), tuple(lines)) for title, lines in sorted(grouped.items())]


def _yscale(lines: list[Line]) -> str:
    values = [v for line in lines for v in line.values if math.isfinite(v)]
    return "log" if values and min(values) > 0 and max(values) > 100 * min(values) else "linear"


def draw(panels: list[Panel], title: str) -> Any:
    """The matplotlib figure of `panels` (see `plot_plan`), three panels a row."""
    plt = _pyplot()
    columns = min(3, len(panels))
    rows = math.ceil(len(panels) / columns)
    figure, axes = plt.subplots(rows, columns, figsize=(4.5 * columns, 3.2 * rows), squeeze=False)
    for ax in axes.flat[len(panels):]:
        ax.set_visible(False)
    for ax, panel in zip(axes.flat, panels, strict=False):
        for line in panel.lines:
            marker = "o" if line.eval else "." if len(line.steps) < 50 else None
            ax.plot(line.steps, line.values, color=line.color, marker=marker, markersize=4 if line.eval else 6,
                    linestyle="--" if line.eval else "-", label=line.label)
        ax.set_yscale(panel.yscale)
        ax.set_title(panel.title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3, which="both" if panel.yscale == "log" else "major")
        if len(panel.lines) > 1 or panel.lines[0].eval:
            ax.legend(fontsize=7)
    # Wrapped to the figure's width (about 6 pixels a character at 9 points): several runs' paths
    # make a line wider than one panel's figure.
    figure.suptitle(textwrap.fill(title, width=max(40, int(figure.get_figwidth() * figure.dpi / 6))), fontsize=9)
    figure.tight_layout()
    return figure


def _pyplot() -> Any:
    """matplotlib's pyplot on the Agg backend (files only: no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _run_label(workdir: str, taken: Mapping[str, Any]) -> str:
    """A short name for a run in a legend: its directory's name, made unique."""
    label = os.path.basename(os.path.normpath(workdir)) or workdir
    for n in itertools.count(2):
        if label not in taken:
            return label
        label = f"{os.path.basename(os.path.normpath(workdir))} ({n})"
    return label


def records(path: str) -> list[dict[str, Any]]:
    """The records of a metrics.jsonl. A line that is no JSON record of a step (one a
    killed writer cut off, bytes that are not UTF-8 text) is skipped with a note on
    stderr naming the file and the line: what the rest of the file holds stays usable.

    Raises:
      ConfigError: the file cannot be read (a directory, no permission).
    """
    if not os.path.exists(path):
        return []
    records, bad = [], []
    try:
        with open(path, "rb") as file:
            for number, line in enumerate(file, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line.decode("utf-8"))
                except ValueError:  # UnicodeDecodeError too
                    bad.append(number)
                    continue
                if isinstance(record, dict) and isinstance(record.get("step"), int):
                    records.append(record)
                elif not (isinstance(record, dict) and set(record) == {"hparams"}):  # the header is no step's
                    bad.append(number)
    except OSError as error:
        raise _given_wrong(f"Cannot read {shown(path)}: {error.strerror or error}.") from error
    if bad:
        lines = ("line " if len(bad) == 1 else "lines ") + ", ".join(map(str, bad[:3])) + (", ..." * (len(bad) > 3))
        print(f"jaxmon: skipped {len(bad)} unreadable line(s) of {shown(path)} ({lines}): not a JSON record "
              "of a step", file=sys.stderr)
    return records


def is_run(workdir: str) -> bool:
    """Whether the directory `workdir` holds what a run writes: a complete checkpoint,
    metrics.jsonl, TensorBoard event files or hparams.json."""
    from jaxmon._checkpoints.step_dirs import complete_steps
    from jaxmon._writers.events import event_files

    files = [os.path.join(workdir, name) for name in ("metrics.jsonl", "hparams.json")]
    return bool(complete_steps(workdir) or event_files(workdir) or any(map(os.path.isfile, files)))


def check_run(workdir: str) -> None:
    """Checks that `workdir` is a run's directory (`is_run`).

    Raises:
      ConfigError: `workdir` is no directory, or not a run's.
    """
    if not os.path.isdir(workdir):
        raise _given_wrong(f"No run directory at {workdir!r}; pass the --workdir of a `jaxmon train` run.")
    if not is_run(workdir):
        raise _given_wrong(f"{workdir!r} is not a jaxmon run: it holds no checkpoint, metrics.jsonl, "
                           "TensorBoard event file or hparams.json. Pass the --workdir of a `jaxmon train` run.")


def _given_wrong(message: str) -> Exception:
    """A ConfigError: the command exits 2 with `message`."""
    from jaxmon._base.errors import ConfigError

    return ConfigError(message)


def shown(value: Any) -> str:
    r"""`value` as text safe to print on a terminal: characters that are not printable
    (terminal escape sequences' ESC, carriage returns, bidirectional overrides) as their
    Python escapes.

    Example:
      >>> print(shown("2024-01-01\x1b[2J"))
      2024-01-01\x1b[2J
    """
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in str(value))


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
