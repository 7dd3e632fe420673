"""The `jaxmon` command: train from a config, inspect a run, plot its curves."""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import logging
import math
import os
import sys
import threading
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

_DESCRIPTION = """\
Train, inspect and plot jaxmon runs.

  jaxmon train --config configs/default.py --workdir runs/default
  jaxmon train --config configs/default.py --workdir runs/lr --config.optimizer.learning_rate=1e-3
  jaxmon inspect runs/default
  jaxmon plot runs/default

A run's directory holds its checkpoints (one directory per step), TensorBoard event
files (`tensorboard --logdir runs`) and metrics.jsonl (one JSON line per step).
"""

_TRAIN = """\
Train the experiment a config file describes, in DIR. If DIR has checkpoints, training
resumes from the latest one (state, step, data position and hooks), so the same command
continues an interrupted run; changing the model, data, task, seed or optimizer of a
run that has checkpoints is an error (start a new DIR, or warm-start from the old one
with --config.warm_start=OLD_DIR).

The config is a Python file whose get_config() returns a dict, or a YAML file, with the
sections seed, steps, data, model, task, optimizer, hooks, session and warm_start:
configs/default.py shows and explains each. Override any value with --config.KEY=VALUE
(dotted keys, list items by index: --config.hooks.1.every_n_steps=100; None turns a
setting off); the value must have the type of the value it replaces, and an unknown
key is an error listing the keys that exist there.

Exit codes: 0 trained (or already at the last step); 2 something given wrong (the
config's syntax, a key, a type or a value, a --workdir that is a file, unwritable or in
use by another run); 1 training failed (a non-finite loss, a failed save, a hook's
error); 130 stopped by Ctrl-C and 143 by SIGTERM, each after saving a checkpoint at
the step it stopped on (run the same command to resume). A failure ends with one line
saying what failed; its traceback is in DIR/jaxmon-error.log (--debug prints it).
"""


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the `jaxmon` command; returns its exit code."""
    parser = argparse.ArgumentParser(prog="jaxmon", description=_DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    train = commands.add_parser("train", help="train from a config (resumes from WORKDIR)", description=_TRAIN,
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                usage="jaxmon train --config FILE --workdir DIR [--config.KEY=VALUE ...]")
    train.add_argument("--config", required=True, metavar="FILE", help="the experiment's config file")
    train.add_argument("--workdir", required=True, metavar="DIR", help="the run's directory (created if needed)")
    train.add_argument("--quiet", action="store_true", help="log warnings only")
    train.add_argument("--debug", action="store_true", help="print a failure's traceback and library logs")
    cache = train.add_mutually_exclusive_group()
    cache.add_argument("--compilation_cache", metavar="CACHE_DIR",
                       help="keep compiled programs here, so that a restart does not compile them again "
                            "(default: DIR/compilation_cache, or JAX_COMPILATION_CACHE_DIR if set)")
    cache.add_argument("--no_compilation_cache", action="store_true", help="compile everything at every start")
    inspect = commands.add_parser("inspect", help="a run's checkpoints, latest metrics and config",
                                  description="List a run's checkpoints (step, size, time; with a saver's "
                                              "keep_best, each one's best_metric and the best marked), its "
                                              "latest metrics and the config it was trained with.")
    inspect.add_argument("workdir", metavar="DIR")
    inspect.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    plot = commands.add_parser("plot", help="PNG curves of runs' scalar summaries (needs matplotlib)",
                               description="Plot every scalar of each DIR/metrics.jsonl against the step into "
                                           "one PNG: a run's train and eval values of a metric (loss, eval/loss) "
                                           "on shared axes, several runs overlaid with a legend (matplotlib: "
                                           "pip install 'jaxmon[plot]').")
    plot.add_argument("workdirs", nargs="+", metavar="DIR")
    plot.add_argument("--out", metavar="PNG",
                      help="the image to write (default DIR/metrics.png, or ./metrics.png for several runs)")
    plot.add_argument("--tags", nargs="+", metavar="TAG", help="only these scalars")
    for command in (inspect, plot):
        command.add_argument("--debug", action="store_true", help="print a failure's traceback")

    overrides, rest = _split_overrides(list(sys.argv[1:] if argv is None else argv))
    args = parser.parse_args(rest)
    if overrides and args.command != "train":
        parser.error(f"config overrides ({overrides[0]}) go with `jaxmon train`.")
    from jaxmon._experiment.config_file import ConfigError

    try:
        if args.command == "train":
            return _train(args, overrides)
        if args.command == "inspect":
            return _inspect(args)
        return _plot(args)
    except ConfigError as error:
        return _fail(args, 2, str(error), error)
    except BrokenPipeError:  # `jaxmon inspect DIR | head`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except KeyboardInterrupt as error:
        return _fail(args, 130, _interrupted(args, error), error)
    except Exception as error:
        return _fail(args, 1, _one_line(error), error)


def _fail(args: argparse.Namespace, code: int, message: str, error: BaseException) -> int:
    """Ends a failed command: its traceback into the run's jaxmon-error.log (printed
    too with --debug), then one line on stderr; returns the exit code."""
    import traceback

    sys.stdout.flush()
    text = "".join(traceback.format_exception(error))
    if args.debug:
        print(text, file=sys.stderr, end="")
    workdir = getattr(args, "workdir", None)
    if code == 1 and isinstance(workdir, str) and os.path.isdir(workdir):
        log = os.path.join(workdir, "jaxmon-error.log")
        try:
            with open(log, "a", encoding="utf-8") as file:
                file.write(f"{datetime.datetime.now().isoformat(timespec='seconds')} exit {code}\n{text}\n")
            if not args.debug:
                print(f"jaxmon {args.command}: the traceback is in {log} (--debug prints it here).", file=sys.stderr)
        except OSError:  # a full disk, say: the line below still says what failed
            pass
    print(f"jaxmon {args.command}: {message}", file=sys.stderr, flush=True)
    return code


def _one_line(error: BaseException) -> str:
    """What failed, in one line: the error's type, message and notes (which hook, which step)."""
    parts = [f"{type(error).__name__}: {error}", *getattr(error, "__notes__", ())]
    return " ".join(" ".join(part.split()) for part in parts if part)


def _interrupted(args: argparse.Namespace, error: KeyboardInterrupt) -> str:
    """The line of a Ctrl-C: the session's stop, saved (its message), or a second Ctrl-C."""
    from jaxmon._checkpoint import complete_steps

    workdir = getattr(args, "workdir", None)
    steps = complete_steps(workdir) if isinstance(workdir, str) and os.path.isdir(workdir) else []
    if error.args and steps:  # the session stopped, saved and closed, then re-raised Ctrl-C
        return f"{error.args[0]}; checkpoint {steps[-1]} is saved: run the same command to resume."
    stands = f"checkpoint {steps[-1]} stands" if steps else "no checkpoint was saved"
    return f"Interrupted (Ctrl-C): the save in progress, if any, was abandoned; {stands}."


def run() -> None:
    """The `jaxmon` program: `main()`, then exit with its code. After a failure the
    process ends at once: what Orbax's threads would still print while Python shuts
    down would come after the line that says what failed."""
    code = main()
    if code:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


def _split_overrides(argv: list[str]) -> tuple[list[str], list[str]]:
    """`--config.KEY=VALUE` (or `--config.KEY VALUE`, the absl habit) apart from the rest."""
    overrides, rest, i = [], [], 0
    while i < len(argv):
        arg = argv[i]
        if arg.startswith("--config.") and "=" not in arg and i + 1 < len(argv):
            overrides.append(f"{arg}={argv[i + 1]}")
            i += 2
            continue
        (overrides if arg.startswith("--config.") else rest).append(arg)
        i += 1
    return overrides, rest


def _train(args: argparse.Namespace, overrides: list[str]) -> int:
    from jaxmon._experiment import train_experiment
    from jaxmon._experiment.config_file import load_config

    config = load_config(args.config, overrides)
    log = logging.getLogger("jaxmon")
    if not log.handlers:
        handler = _ClearLineHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(message)s", "%H:%M:%S"))
        log.addHandler(handler)
        log.propagate = False  # libraries may have configured the root logger too
    log.setLevel(logging.WARNING if args.quiet else logging.INFO)
    if not args.debug:  # tracebacks go to jaxmon-error.log; Orbax's own (absl) logs only with --debug
        for handler in log.handlers:
            if isinstance(handler, _ClearLineHandler):
                handler.show_tracebacks = False
        logging.getLogger("absl").setLevel(logging.CRITICAL)
        sys.stderr = _MainThreadOnly(sys.stderr, os.path.join(args.workdir, "jaxmon-error.log"))
    cache = False if args.no_compilation_cache else args.compilation_cache or True
    result = train_experiment(config, args.workdir, report=lambda line: print(line, flush=True),
                              compilation_cache=cache)
    return result.get("exit_code", 0)


class _MainThreadOnly:
    """stderr for what the main thread writes (log lines, the progress bar); what other
    threads print on their own (Orbax's after a failed save: "Event loop is closed"
    tracebacks) goes to the file `log` instead."""

    def __init__(self, stream: Any, log: str):
        self._stream, self._log = stream, log

    def write(self, text: str) -> int:
        if threading.current_thread() is threading.main_thread():
            return self._stream.write(text)
        try:
            with open(self._log, "a", encoding="utf-8") as file:
                file.write(text)
        except OSError:
            pass
        return len(text)

    def flush(self) -> None:
        self._stream.flush()

    def __getattr__(self, name: str) -> Any:  # isatty, fileno, encoding, ...
        return getattr(self._stream, name)


class _ClearLineHandler(logging.StreamHandler):
    """Logs to stderr; on a terminal, first clears the line a progress bar is drawn on
    (the bar redraws itself below)."""

    show_tracebacks = True

    def emit(self, record: logging.LogRecord) -> None:
        if getattr(self.stream, "isatty", lambda: False)():
            self.stream.write("\r\x1b[K")
        if not self.show_tracebacks and record.exc_info:
            record = logging.makeLogRecord({**record.__dict__, "exc_info": None, "exc_text": None})
        super().emit(record)


def _inspect(args: argparse.Namespace) -> int:
    info = run_info(args.workdir)
    if args.json:
        print(json.dumps(info, indent=2, default=str))
        return 0
    print(f"run {info['workdir']}")
    if info["checkpoints"]:
        print(f"checkpoints ({len(info['checkpoints'])}):")
        for item in info["checkpoints"]:
            best = "" if item["best_metric"] is None else f"  best_metric {item['best_metric']:.6g}"
            mark = {None: "", 1: "  (best)"}.get(item["best_rank"], f"  (#{item['best_rank']})")
            print(f"  step {item['step']:>8}  {_size(item['bytes']):>9}  {item['time']}{best}{mark}")
    else:
        print("checkpoints: none")
    if info["metrics"]:
        print("latest metrics:")
        width = max(len(tag) for tag in info["metrics"])
        for tag, (step, value) in sorted(info["metrics"].items()):
            print(f"  {tag:<{width}}  {value:.6g}  (step {step})")
    else:
        print("latest metrics: none (no metrics.jsonl)")
    if info["config"] is not None:
        print("config:")
        for line in json.dumps(info["config"], indent=2, sort_keys=True).splitlines():
            print(f"  {line}")
    else:
        print("config: none saved")
    return 0


def run_info(workdir: str) -> dict[str, Any]:
    """What `jaxmon inspect` shows, as a dict: checkpoints (step, bytes, time; with
    `keep_best`, the `best_metric` ranked: `best_rank` 1 is the best), the latest value of
    each scalar in metrics.jsonl, and the latest checkpoint's config."""
    from jaxmon._checkpoint import complete_steps, read_meta

    if not os.path.isdir(workdir):
        from jaxmon._experiment.config_file import ConfigError

        raise ConfigError(f"No run directory at {workdir!r}; pass the --workdir of a `jaxmon train` run.")
    checkpoints = []
    for step in complete_steps(workdir):
        path = os.path.join(workdir, str(step))
        meta = read_meta(path) or {}
        when = meta.get("time") or datetime.datetime.fromtimestamp(os.path.getmtime(path)).astimezone().isoformat(
            timespec="seconds")
        checkpoints.append({"step": step, "bytes": _du(path), "time": when, **_best_metric(path)})
    _rank_best(checkpoints)
    metrics: dict[str, tuple[int, float]] = {}
    for record in _records(os.path.join(workdir, "metrics.jsonl")):
        for tag, value in record.items():
            if tag not in ("step", "wall_time") and _is_number(value) and math.isfinite(value):
                metrics[tag] = (record["step"], value)
    config = None
    if checkpoints:
        config = (read_meta(os.path.join(workdir, str(checkpoints[-1]["step"]))) or {}).get("config")
    return {"workdir": workdir, "checkpoints": checkpoints, "metrics": metrics, "config": config}


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


def _plot(args: argparse.Namespace) -> int:
    try:
        plt = _pyplot()
    except ImportError:
        print("jaxmon plot needs matplotlib: pip install 'jaxmon[plot]' (or pip install matplotlib).",
              file=sys.stderr)
        return 2
    runs = {}  # each run's label: {tag: (steps, values)}
    for workdir in args.workdirs:
        path = os.path.join(workdir, "metrics.jsonl")
        if not os.path.exists(path):
            print(f"jaxmon plot: no metrics.jsonl in {workdir!r}; summaries of a run go there "
                  "(SummarySaverHook / MonitoredTrainingSession with a checkpoint or summary dir).", file=sys.stderr)
            return 2
        series = read_series(path)
        if args.tags:
            missing = sorted(set(args.tags) - set(series))
            if missing:
                print(f"jaxmon plot: no scalar {missing[0]!r} in {path}; it has {', '.join(sorted(series))}.",
                      file=sys.stderr)
                return 2
            series = {tag: series[tag] for tag in args.tags}
        if not series:
            print(f"jaxmon plot: {path} holds no scalars.", file=sys.stderr)
            return 2
        runs[_run_label(workdir, runs)] = series
    tags = sorted({tag for series in runs.values() for tag in series})
    figure = draw(plot_plan(runs), ", ".join(os.path.abspath(workdir) for workdir in args.workdirs))
    out = args.out or os.path.join(args.workdirs[0] if len(args.workdirs) == 1 else ".", "metrics.png")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    figure.savefig(out, dpi=100)
    plt.close(figure)
    shown = f"{len(runs)} runs, " if len(runs) > 1 else ""
    print(f"wrote {out} ({shown}{len(tags)} scalars: {', '.join(tags)})")
    return 0


def read_series(path: str) -> dict[str, tuple[list[int], list[float]]]:
    """Every scalar of a metrics.jsonl: `{tag: (steps, values)}`."""
    series: dict[str, tuple[list[int], list[float]]] = {}
    for record in _records(path):
        for tag, value in record.items():
            if tag not in ("step", "wall_time") and _is_number(value):
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
    figure.suptitle(title, fontsize=9)
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


def _records(path: str) -> list[dict[str, Any]]:
    """The records of a metrics.jsonl; a line cut off by a killed writer, or one without
    a step, is skipped with a note on stderr."""
    if not os.path.exists(path):
        return []
    records, bad = [], 0
    with open(path) as file:
        for line in file:
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError:
                bad += 1
                continue
            if isinstance(record, dict) and isinstance(record.get("step"), int):
                records.append(record)
            elif not (isinstance(record, dict) and set(record) == {"hparams"}):  # the header is no step's
                bad += 1
    if bad:
        print(f"jaxmon: skipped {bad} unreadable line(s) of {path}", file=sys.stderr)
    return records


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _du(path: str) -> int:
    return sum(os.path.getsize(os.path.join(root, name)) for root, _, names in os.walk(path) for name in names)


def _size(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


if __name__ == "__main__":
    sys.exit(main())
