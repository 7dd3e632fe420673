"""`jaxmon check`: a config's preflight, printed before anything trains."""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping
from typing import Any

from jaxmon._base.paths import size_text

_CHECK = """\
Build what a config describes and compile its programs, without training: print the
resolved config, the parameters per top-level module, the mesh, each state leaf's shape
and sharding, the global batch, and each program's compile time and memory per device
(XLA's memory analysis): the step for runs of one step and of session.steps_per_dispatch
steps, and the evaluation. A parameter or batch that the mesh cannot split is one line
naming it, its shape and the mesh axis (exit 2), as is any other config error. Run it on
the devices you will train on (with the same XLA_FLAGS, on every host).

  jaxmon check --config configs/lm.py
  XLA_FLAGS=--xla_force_host_platform_device_count=8 jaxmon check --config configs/lm_fsdp.py

With --resume it proves instead that the config's run resumes as one run: it trains
--steps steps three times, as real `jaxmon train` processes: whole; cut by SIGKILL
once its middle checkpoint is complete; and resumed from there (--processes N for
both, --resume-processes M for the resume). It then compares the final state (bit for
bit), every metrics.jsonl value (timings aside) and the checkpoints kept, printing one
line per difference, or that there is none (exit 1 if any); runs that differ before the
cut end with a line saying the data or the init is not deterministic, and how to seed
them. The runs go into --workdir (default: a new temporary directory, removed when the
check ends, however it ends).

  jaxmon check --resume --config configs/default.py
  jaxmon check --resume --config configs/default.py --processes 2 --resume-processes 1
"""


def add_check(commands: Any) -> argparse.ArgumentParser:
    """Adds `jaxmon check` to `commands` (the main parser's subparsers)."""
    check = commands.add_parser("check", help="a config's preflight: parameters, mesh, shardings, memory",
                                description=_CHECK, formatter_class=argparse.RawDescriptionHelpFormatter,
                                usage="jaxmon check --config FILE [--json] [--resume [--steps N] [--processes N] "
                                      "[--resume-processes M] [--workdir DIR]] [--config.KEY=VALUE ...]")
    check.add_argument("--config", required=True, metavar="FILE", help="the experiment's config file")
    check.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    check.add_argument("--resume", action="store_true",
                       help="prove that a run cut by SIGKILL and resumed is the run never cut")
    check.add_argument("--steps", type=int, default=20, metavar="N", help="with --resume: steps per run (20)")
    check.add_argument("--processes", type=int, default=1, metavar="N",
                       help="with --resume: JAX processes of each run on this machine (1)")
    check.add_argument("--resume-processes", type=int, default=None, metavar="M",
                       help="with --resume: JAX processes of the resumed run (default: --processes)")
    check.add_argument("--workdir", default=None, metavar="DIR", help="with --resume: where the runs go")
    check.set_defaults(handler=_check, takes_overrides=True)
    return check


def _check(args: argparse.Namespace) -> int:
    from jaxmon._base import signals as _signals
    from jaxmon._base.errors import ConfigError
    from jaxmon._experiment.config_file import load_config
    from jaxmon._experiment.keys import check_keys
    from jaxmon._experiment.trackers import writers_of

    if args.resume:
        from jaxmon._cli.resume_check import check_resume

        for name in ("processes", "resume_processes"):
            count = getattr(args, name)
            if count is not None and count < 1:
                raise ConfigError(f"--{name.replace('_', '-')} {count}: give a number of processes, at least 1.")
        return check_resume(args.config, args.overrides, steps=args.steps, processes=args.processes,
                            resume_processes=args.resume_processes, workdir=args.workdir)
    if args.steps != 20 or args.processes != 1 or args.resume_processes is not None or args.workdir is not None:
        raise ConfigError("--steps, --processes, --resume-processes and --workdir are options of --resume: add it.")

    with _signals.loading():
        config = load_config(args.config, args.overrides)
        check_keys(config)  # before JAX loads
        writers_of(config.get("writers"), "")  # a tracker's missing package or unusable URI too
        from jaxmon._experiment.preflight import check_experiment
        from jaxmon._processes.launch import connect
    connect()
    report = check_experiment(config)
    print(json.dumps(report, default=str) if args.json else format_report(report), flush=True)
    return 0


def format_report(report: Mapping[str, Any]) -> str:
    """The report of `check_experiment` as the text `jaxmon check` prints."""
    lines = ["config:", *("  " + line for line in json.dumps(report["config"], indent=2, default=str).splitlines())]
    lines.append("parameters:")
    lines += [f"  {name:<24} {count:>14,}" for name, count in report["parameters"].items()]
    mesh = report["mesh"]
    lines.append("mesh: " + ("none (one device)" if mesh is None else
                             " x ".join(f"{name}={size}" for name, size in mesh.items())) +
                 f"  devices: {', '.join(report['devices'])}")
    params = [row for row in report["state"] if row["path"].startswith("state.params")] or report["state"]
    rest = [row for row in report["state"] if row not in params]
    lines.append("parameters (path, shape, dtype, sharding):")
    width = max((len(row["path"]) for row in params), default=0)
    lines += [f"  {row['path']:<{width}}  {str(tuple(row['shape'])):<18} {row['dtype']:<8} {row['sharding']}"
              for row in params]
    if rest:
        split = sum(row["sharding"] not in ("replicated", "one device") for row in rest)
        lines.append(f"other state (optimizer, step): {len(rest)} arrays, {split} split like their parameters "
                     "(--json lists each)")
    lines.append("batch (global):")
    lines += [f"  {key}: {tuple(value['shape'])} {value['dtype']}"
              + (f"  {value['sharding']}" if value["sharding"] else "") for key, value in report["batch"].items()]
    lines.append("programs (compile time; memory per device):")
    width = max(len(program["name"]) for program in report["programs"])
    lines += [f"  {program['name']:<{width}}  {program['compile_secs']:6.2f} s  "
              + ", ".join(f"{name} {size_text(n)}" for name, n in program["memory_per_device"].items())
              for program in report["programs"]]
    return "\n".join(lines)
