"""Where a step's device time goes: a `jax.profiler` trace of a few steady steps of a
config's step, and the ops that took most of the device's time.

`top_ops(trace)` reads a trace as `jax.profiler` writes it: the Chrome trace JSON of
`*.trace.json.gz` (plain `json` and `gzip`: no profiler plugin needed), or the events of
an `*.xplane.pb` read through `jax.profiler.ProfileData` where no JSON was written. The
device's work is:
- on a GPU (or a TPU), the events of the device's streams (threads named "Stream ..."),
  one kernel each, grouped by the XLA op that launched it (`hlo_op`); without stream
  events, the device's "XLA Ops" line;
- on a CPU, where XLA's ops run on the host's threads, the events that name an `hlo_op`.
Each event counts its own time: events nested in it on its thread are taken off. An
op's share is of the sum over all ops (on a GPU, streams running side by side add up).

The capture builds the config's step as `jaxmon train` does (the model, the task, the
data, `--override`s applied) and runs it in a `jm.MonitoredSession`: --warmup steps
(the compile), then --steps traced. The state is zeros of the initial state's shapes: an
op's time does not depend on the values, and the random initialisation alone would take
tens of seconds to compile on a GPU.

Run: python benchmarks/profile_top_ops.py --config configs/gpt2_small.py --logdir /tmp/profile [--steps 5]
         [--warmup 3] [--top 15] [--override model.num_layers=2]
     python benchmarks/profile_top_ops.py --trace DIR_OR_FILE   (read a trace taken before)
Prints a table (stderr) and JSON (stdout).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import gzip
import json
import pathlib
import sys
import time
from collections.abc import Iterator, Mapping
from typing import Any, NamedTuple


class Op(NamedTuple):
    """One XLA op's device time over the trace: its name, module, microseconds, events, and
    the name of its longest-running kernel (its event name, where that differs)."""

    name: str
    module: str
    us: float
    count: int
    kernel: str


class Profile(NamedTuple):
    """The ops of a trace, the most time first, the sum of their time, and which events were read."""

    ops: list[Op]
    total_us: float
    source: str

    def percent(self, op: Op) -> float:
        return 100.0 * op.us / self.total_us if self.total_us else 0.0


def top_ops(trace: Mapping[str, Any] | list[dict[str, Any]]) -> Profile:
    """The device time of every XLA op in a Chrome trace (`{"traceEvents": [...]}`).

    Raises:
      ValueError: the trace holds no event of an XLA op (naming its processes).
    """
    events = trace["traceEvents"] if isinstance(trace, Mapping) else trace
    processes = {e["pid"]: e.get("args", {}).get("name", "") for e in events if _meta(e, "process_name")}
    threads = {(e["pid"], e.get("tid")): e.get("args", {}).get("name", "") for e in events if _meta(e, "thread_name")}
    spans = [e for e in events if e.get("ph") == "X" and e.get("dur") is not None]
    source, chosen = _device_work(spans, processes, threads)
    if not chosen:
        raise ValueError(f"the trace holds no event of an XLA op (its processes: {sorted(set(processes.values()))}); "
                         "trace steps that run on the device, after their compile")
    time_of: dict[str, float] = collections.defaultdict(float)
    count: collections.Counter = collections.Counter()
    module: dict[str, str] = {}
    kernels: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for event, own in zip(chosen, _own_times(chosen), strict=True):
        args = event.get("args") or {}
        name = str(args.get("hlo_op") or event["name"])
        time_of[name] += own
        count[name] += 1
        module.setdefault(name, str(args.get("hlo_module", "")))
        kernels[name][str(event["name"])] += own
    ops = [Op(name, module[name], us, count[name], _kernel(name, kernels[name])) for name, us in time_of.items()]
    ops.sort(key=lambda op: -op.us)
    return Profile(ops, sum(time_of.values()), source)


def _meta(event: Mapping[str, Any], name: str) -> bool:
    return event.get("ph") == "M" and event.get("name") == name


def _device_work(spans: list[dict], processes: dict, threads: dict) -> tuple[str, list[dict]]:
    """Which events are the device's work, and a word on which (see the module's docstring)."""
    device = {pid for pid, name in processes.items() if name.startswith("/device:") and "CPU" not in name}
    on_device = [e for e in spans if e["pid"] in device]
    streams = [e for e in on_device if threads.get((e["pid"], e.get("tid")), "").startswith("Stream")]
    if streams:
        return "the device's stream events (kernels)", streams
    ops_line = [e for e in on_device if threads.get((e["pid"], e.get("tid"))) == "XLA Ops"]
    if ops_line:
        return "the device's XLA Ops line", ops_line
    on_host = [e for e in spans if e["pid"] not in device and "hlo_op" in (e.get("args") or {})]
    if device:  # a GPU's process without events: its tracer recorded nothing (CUPTI not allowed, say)
        return "no device events recorded: the host's events that name an XLA op (launches, not device time)", on_host
    return "XLA's ops on the host's threads (a CPU device)", on_host


def _own_times(events: list[dict]) -> list[float]:
    """Each event's duration less that of the events nested in it on its thread."""
    own = [float(e["dur"]) for e in events]
    by_thread: dict[Any, list[int]] = collections.defaultdict(list)
    for i, event in enumerate(events):
        by_thread[event["pid"], event.get("tid")].append(i)
    for indices in by_thread.values():
        indices.sort(key=lambda i: (float(events[i]["ts"]), -float(events[i]["dur"])))
        open_spans: list[tuple[float, int]] = []  # (end, index), innermost last
        for i in indices:
            start = float(events[i]["ts"])
            while open_spans and open_spans[-1][0] <= start:
                open_spans.pop()
            end = start + float(events[i]["dur"])
            if open_spans:
                parent_end, parent = open_spans[-1]
                own[parent] -= min(end, parent_end) - start
            open_spans.append((end, i))
    return [max(value, 0.0) for value in own]


def _kernel(op: str, kernels: collections.Counter) -> str:
    name = kernels.most_common(1)[0][0]
    return "" if name == op else name


def find_trace(path: str | pathlib.Path) -> pathlib.Path:
    """The trace file at `path`: the file itself, or in a `jax.profiler` log directory the
    newest run's `*.trace.json.gz`, else its `perfetto_trace.json.gz`, else its `*.xplane.pb`.

    Raises:
      FileNotFoundError: none there (naming what is there).
    """
    path = pathlib.Path(path)
    if path.is_file():
        return path
    runs = [run for run in (path / "plugins" / "profile").glob("*") if run.is_dir()] or [path]
    newest = max(runs, key=lambda run: run.stat().st_mtime)
    for pattern in ("*.trace.json.gz", "perfetto_trace.json.gz", "*.xplane.pb"):
        found = sorted(newest.glob(pattern))
        if found:
            return found[0]
    raise FileNotFoundError(f"no *.trace.json.gz, perfetto_trace.json.gz or *.xplane.pb in {newest} (it holds: "
                            f"{sorted(p.name for p in newest.iterdir()) if newest.is_dir() else 'nothing'})")


def load_trace(path: str | pathlib.Path) -> dict[str, Any]:
    """The Chrome trace of the file at `path` (`find_trace`), an `*.xplane.pb` converted."""
    path = pathlib.Path(path)
    if path.name.endswith(".xplane.pb"):
        return {"traceEvents": list(_xplane_events(path))}
    with gzip.open(path, "rt") if path.suffix == ".gz" else open(path) as file:
        return json.load(file)


def _xplane_events(path: pathlib.Path) -> Iterator[dict[str, Any]]:
    from jax.profiler import ProfileData

    for pid, plane in enumerate(ProfileData.from_file(str(path)).planes):
        yield {"ph": "M", "pid": pid, "name": "process_name", "args": {"name": plane.name}}
        for tid, line in enumerate(plane.lines):
            yield {"ph": "M", "pid": pid, "tid": tid, "name": "thread_name", "args": {"name": line.name}}
            for event in line.events:
                yield {"ph": "X", "pid": pid, "tid": tid, "name": event.name, "ts": event.start_ns / 1e3,
                       "dur": event.duration_ns / 1e3, "args": dict(event.stats)}


def table(profile: Profile, top: int, steps: int) -> str:
    """The `top` ops as a Markdown table: ms over the steps, ms a step, share of the device time."""
    lines = ["| op | module | ms | ms/step | % | events | kernel |", "|---|---|---|---|---|---|---|"]
    for op in profile.ops[:top]:
        lines.append(f"| {op.name[:60]} | {op.module[:40]} | {op.us / 1e3:.3f} | {op.us / 1e3 / steps:.3f} "
                     f"| {profile.percent(op):.1f} | {op.count} | {op.kernel[:60]} |")
    return "\n".join(lines)


def report(profile: Profile, top: int, steps: int, **fields: Any) -> dict[str, Any]:
    """The JSON the script prints: the device time a step, and the `top` ops."""
    return {**fields, "steps": steps, "source": profile.source, "ops": len(profile.ops),
            "device_ms_per_step": round(profile.total_us / 1e3 / steps, 3),
            "top_ops": [{"op": op.name, "module": op.module, "ms": round(op.us / 1e3, 3),
                         "percent": round(profile.percent(op), 2), "events": op.count, "kernel": op.kernel}
                        for op in profile.ops[:top]]}


@contextlib.contextmanager
def tracing(logdir: str) -> Iterator[None]:
    """A `jax.profiler` trace into `logdir`, with a Chrome trace where this JAX takes the
    option; if only that copy fails, the trace's other files are kept and read."""
    import jax

    try:
        jax.profiler.start_trace(logdir, create_perfetto_trace=True)
    except TypeError:  # a JAX without the option
        jax.profiler.start_trace(logdir)
    try:
        yield
    finally:
        try:
            jax.profiler.stop_trace()
        except ValueError as error:  # "Invalid trace folder": no JSON to copy; find_trace takes the xplane.pb
            print(f"profile_top_ops: the Chrome trace was not written ({error})", file=sys.stderr)


def capture(config_path: str, overrides: list[str], logdir: str, warmup: int, steps: int) -> float:
    """Traces `steps` steps of the config's step into `logdir` after `warmup` steps; returns
    the traced steps' wall time in seconds."""
    import jax
    import jax.numpy as jnp

    import jaxmon as jm
    from jaxmon._experiment.parts import parts_of

    parts = parts_of(jm.load_config(config_path, overrides))
    shapes = jax.eval_shape(parts.init_fn)
    state = jax.jit(lambda: jax.tree.map(lambda leaf: jnp.zeros(leaf.shape, leaf.dtype), shapes))()
    data = jm.ArrayDataSource(parts.data.train, parts.data.batch_size, seed=parts.seed)
    with jm.MonitoredSession(parts.task.step_fn, state=state, data=data) as sess:
        for _ in range(warmup):
            sess.run()
        jax.block_until_ready(sess.state)
        with tracing(logdir):
            start = time.perf_counter()
            for _ in range(steps):
                sess.run()
            jax.block_until_ready(sess.state)
            wall = time.perf_counter() - start
    return wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", help="a config file (e.g. configs/gpt2_small.py)")
    parser.add_argument("--override", action="append", default=[], help="a config key=value, e.g. model.num_layers=2")
    parser.add_argument("--logdir", help="where the trace goes (with --config)")
    parser.add_argument("--trace", help="read this trace (a file or a profiler log directory) instead of taking one")
    parser.add_argument("--warmup", type=int, default=3, help="untraced steps first (the first compiles)")
    parser.add_argument("--steps", type=int, default=5, help="steps traced")
    parser.add_argument("--top", type=int, default=15)
    args = parser.parse_args()
    if bool(args.trace) == bool(args.config and args.logdir):
        parser.error("give --config and --logdir (take a trace), or --trace (read one)")
    fields: dict[str, Any] = {}
    if args.config:
        import jax

        wall = capture(args.config, args.override, args.logdir, args.warmup, args.steps)
        device = jax.devices()[0]
        fields = {"device": f"{device.platform} {device.device_kind}", "jax": jax.__version__,
                  "config": args.config, "overrides": args.override,
                  "wall_ms_per_step": round(wall * 1e3 / args.steps, 3)}
    path = find_trace(args.trace or args.logdir)
    profile = top_ops(load_trace(path))
    print(table(profile, args.top, args.steps), file=sys.stderr)
    print(json.dumps(report(profile, args.top, args.steps, trace=str(path), **fields)))


if __name__ == "__main__":
    main()
