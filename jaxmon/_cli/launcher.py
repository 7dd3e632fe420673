"""`jaxmon launch -n N -- COMMAND ...`: N processes of your own program, connected as
several hosts are, on this machine (what `jaxmon train --processes N` does for a config)."""

from __future__ import annotations

import argparse
import os
from typing import Any

_LAUNCH = """\
Run COMMAND (your training script, say) in N processes on this machine, on the CPU,
connected as several hosts are: each gets JAX_COORDINATOR_ADDRESS (a free port of
127.0.0.1), JAX_NUM_PROCESSES and JAX_PROCESS_ID, which jm.distributed.initialize()
(or jax.distributed.initialize(coordinator_address=..., ...)) reads, and this
environment (XLA_FLAGS=--xla_force_host_platform_device_count=4 gives each 4 CPU
devices). Process 0's output is shown; process i's goes to LOG_DIR/process-<i>.log,
its warnings and errors shown too after [process i]. If a process fails, the others are
stopped and the exit code is the failed one's (128+N if killed by signal N); Ctrl-C or
SIGTERM is passed on to every process as SIGTERM (a second one kills them), and the
launcher exits 130 or 143.

  jaxmon launch -n 2 -- python examples/data_parallel.py
  XLA_FLAGS=--xla_force_host_platform_device_count=4 jaxmon launch -n 2 --log_dir logs -- python train.py
"""


def add_launch(commands: Any) -> argparse.ArgumentParser:
    """Adds `jaxmon launch` to `commands` (the main parser's subparsers)."""
    launch = commands.add_parser("launch", help="run your own program in N connected processes on this machine",
                                 description=_LAUNCH, formatter_class=argparse.RawDescriptionHelpFormatter,
                                 usage="jaxmon launch -n N [--log_dir DIR] -- COMMAND [ARG ...]")
    launch.add_argument("-n", "--processes", required=True, metavar="N", help="how many processes (2 or more)")
    launch.add_argument("--log_dir", default=".", metavar="DIR",
                        help="where process-<i>.log of processes 1.. go (default: this directory)")
    launch.add_argument("--debug", action="store_true", help="print a failure's traceback")
    launch.add_argument("program", nargs=argparse.REMAINDER, metavar="-- COMMAND [ARG ...]",
                        help="the program each process runs")
    launch.set_defaults(handler=_launch)
    return launch


def _launch(args: argparse.Namespace) -> int:
    from jaxmon._base.errors import ConfigError
    from jaxmon._processes.local import launch, processes_option

    program = args.program[1:] if args.program[:1] == ["--"] else args.program
    if not program:
        raise ConfigError("jaxmon launch needs the program to run after --: e.g. jaxmon launch -n 2 -- python "
                          "train.py")
    count = processes_option(args.processes, option="-n")
    if count < 2:
        raise ConfigError(f"-n {count}: jaxmon launch starts 2 or more processes; run the program itself for one.")
    return launch(program, count, os.fspath(args.log_dir), name="jaxmon launch")
