"""The `jaxmon` command: train from a config, inspect a run, plot its curves."""

from __future__ import annotations

import argparse
import atexit
import datetime
import logging
import os
import signal
import sys
import threading
from collections.abc import Sequence
from typing import Any

from jaxmon._base import signals as _signals
from jaxmon._base.paths import LinkedFileError, free_bytes, is_full_disk, open_file, size_text
from jaxmon._cli.runs import (  # noqa: F401  (importable from here too)
    Line,
    Panel,
    _best_metric,
    _inspect,
    _is_number,
    _plot,
    _pyplot,
    _rank_best,
    _run_label,
    _yscale,
    add_inspect,
    add_plot,
    draw,
    plot_plan,
    read_series,
    records,
    run_info,
)

_DESCRIPTION = """\
Train, inspect and plot jaxmon runs.

  jaxmon train --config configs/default.py --workdir runs/default
  jaxmon train --config configs/default.py --workdir runs/lr --config.optimizer.learning_rate=1e-3
  jaxmon inspect runs/default
  jaxmon plot runs/default
  jaxmon sweep --config configs/default.py --workdir runs/sweep --grid seed=0,1 --grid optimizer.learning_rate=1e-3,3e-3
  jaxmon launch -n 2 -- python my_training.py

A run's directory holds its checkpoints (one directory per step), TensorBoard event
files (`tensorboard --logdir runs`) and metrics.jsonl (one JSON line per step).
"""

_TRAIN = """\
Train the experiment a config file describes, in DIR. If DIR has checkpoints, training
resumes from the latest one (state, step, data position and hooks), so the same command
continues an interrupted run; changing the model, data, task, seed or optimizer (any
of its keys, the learning rate too) of a run that has checkpoints is an error naming
each changed key (start a new DIR, or warm-start from the old one with
--config.warm_start=OLD_DIR).

The config is a Python file whose get_config() returns a dict, or a YAML file, with the
sections seed, steps, data, model, task, optimizer, hooks, session and warm_start:
configs/default.py shows and explains each. Override any value with --config.KEY=VALUE
(dotted keys, list items by index: --config.hooks.1.every_n_steps=100; None turns a
setting off); the value must have the type of the value it replaces, and an unknown
key is an error listing the keys that exist there.

Several hosts: run the same command on each. A process is one of several when
JAX_COORDINATOR_ADDRESS (host:port of process 0), JAX_NUM_PROCESSES and JAX_PROCESS_ID
are set, or in a cluster that jax.distributed.initialize() detects (SLURM with several
tasks, Open MPI's mpirun, a multi-host TPU slice, a Kubernetes Job): it connects to the
others before training, and process 0 writes the summaries. --processes N tries it on
this machine: N processes of this command on the CPU, connected on 127.0.0.1, each
with this environment (XLA_FLAGS=--xla_force_host_platform_device_count=4 gives each
4 CPU devices). Process 0's output is shown; process i's goes to DIR/process-<i>.log,
its warnings and errors shown too after [process i]. If a process fails, the others
are stopped and the exit code is the failed one's (128+N if killed by signal N); Ctrl-C
makes every process save at one step they agree on, and stop.

Exit codes: 0 trained (or already at the last step); 2 something given wrong (the
config's syntax, a key, a type or a value, a resume's changed settings, a --workdir
that is a file, unwritable or in use by another run; a DIR the refused command created
is removed again); 1 training failed (a non-finite loss, a failed save, a hook's
error); 75 another process of the run died or stopped answering, so this one stopped
too, at once (the complete checkpoints stand: start every process again to resume);
76 the watchdog (session.watchdog_secs) saw no step complete in time: every thread's
stack and what the loop was doing are above the last line; the same command resumes;
130 stopped by Ctrl-C, 143 by SIGTERM and 129 by SIGHUP (a closed terminal or SSH
session; ignored under nohup), each after saving a checkpoint at the step it stopped
on (run the same command to resume), or before training started, with nothing to
save. A failure ends with one line
saying what failed; its traceback is in DIR/jaxmon-error.log (--debug prints it).
"""


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the `jaxmon` command; returns its exit code. Ctrl-C, SIGTERM and SIGHUP stop it
    from here on with exit 130 / 143 / 129 and one line, never a traceback (see `signals`)."""
    with _signals.handling():
        return _main(list(sys.argv[1:] if argv is None else argv))


def _main(argv: list[str]) -> int:
    args = None
    try:
        with _signals.loading():  # nothing done yet: a signal ends the command at once
            from jaxmon._base.errors import ConfigError

            args = _parse(argv)
        code = args.handler(args)
        _signals.check()  # a signal that a library caught on the way stops the command all the same
        return code
    except BaseException as error:
        if args is None:  # the usage's error or --help (SystemExit)
            raise
        signum = _signals.stopped(error)  # first: whatever a signal became on its way up
        if signum is not None:
            if _signals.launcher_says():  # its launcher says how the stop ended, once for every process
                sys.stdout.flush()
                return _signals.EXIT_CODES[signum]
            return _fail(args, _signals.EXIT_CODES[signum], _stop_line(args, error, signum), error)
        if isinstance(error, ConfigError):
            return _fail(args, 2, str(error), error)
        if isinstance(error, BrokenPipeError):  # `jaxmon inspect DIR | head`
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return 0
        if not isinstance(error, Exception):  # SystemExit
            raise
        agree = sys.modules.get("jaxmon._processes.agree")  # not loaded (no JAX): no PeerError either
        if agree is not None and isinstance(error, agree.PeerError):  # another process died (75) or failed (1)
            return _fail(args, error.exit_code, _one_line(error), error)
        if is_full_disk(error):
            return _fail(args, 1, _full_disk_line(args, error), error)
        return _fail(args, 1, _one_line(error), error)


def _stop_line(args: Any, error: BaseException, signum: int) -> str:
    """The last line of a command stopped by `signum` (`error` reached `main`): the step
    a session stopped and saved at (its message), else whether training had started
    and which checkpoint stands."""
    from jaxmon._checkpoints.step_dirs import complete_steps  # loads no JAX: the signal may have cut JAX's import short

    stopping = sys.modules.get("jaxmon._run.stopping")  # not loaded: no session was entered
    session_entered = getattr(stopping, "session_entered", lambda: False)
    name = _signals.NAMES[signum]
    if getattr(args, "command", None) != "train":
        return f"Stopped by {name}."
    workdir = getattr(args, "workdir", None)
    steps = complete_steps(workdir) if isinstance(workdir, str) and os.path.isdir(workdir) else []
    said = str(error.args[0]) if isinstance(error, KeyboardInterrupt | _signals.Terminated) and error.args else ""
    if said.startswith(f"Stopped by {name} at step "):  # the session stopped, saved and closed
        step = said.rpartition(" ")[2]
        saved = (f"checkpoint {step} is saved" if steps and str(steps[-1]) == step
                 else f"checkpoint {steps[-1]} stands" if steps else "no checkpoint was saved")
        return f"{said}; {saved}: run the same command to resume."
    if not session_entered():
        then = f"checkpoint {steps[-1]} stands: run the same command to resume" if steps else \
            "run the same command to train"
        return f"Stopped by {name} before training started: nothing to save; {then}."
    stands = f"checkpoint {steps[-1]} stands" if steps else "no checkpoint was saved"
    return f"Stopped by {name}: the save in progress, if any, was abandoned; {stands}."


def _parse(argv: list[str]) -> argparse.Namespace:
    """The command line's arguments, `overrides` and `argv` among them."""
    parser = argparse.ArgumentParser(prog="jaxmon", description=_DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    _add_train(commands)
    from jaxmon._cli.check import add_check
    from jaxmon._cli.launcher import add_launch
    from jaxmon._cli.sweep import add_sweep

    add_launch(commands)
    for command in (add_inspect(commands), add_plot(commands), add_check(commands), add_sweep(commands)):
        command.add_argument("--debug", action="store_true", help="print a failure's traceback")
    overrides, rest = _split_overrides(argv)
    args = parser.parse_args(rest)
    if overrides and not getattr(args, "takes_overrides", False):
        parser.error(f"config overrides ({overrides[0]}) go with `jaxmon train`.")
    args.overrides, args.argv = overrides, argv
    return args


def _add_train(commands: Any) -> argparse.ArgumentParser:
    """Adds `jaxmon train` to `commands` (the main parser's subparsers); returns its parser."""
    train = commands.add_parser("train", help="train from a config (resumes from WORKDIR)", description=_TRAIN,
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                usage="jaxmon train --config FILE --workdir DIR [--processes N] "
                                      "[--config.KEY=VALUE ...]")
    train.add_argument("--config", required=True, metavar="FILE", help="the experiment's config file")
    train.add_argument("--workdir", required=True, metavar="DIR", help="the run's directory (created if needed)")
    train.add_argument("--processes", metavar="N",
                       help="start N processes of this command on this machine, on the CPU, connected as "
                            "several hosts are (see above); 1: a plain run")
    train.add_argument("--quiet", action="store_true", help="log warnings only")
    train.add_argument("--debug_host_syncs", action="store_true",
                       help="raise where the data or a hook called on every run reads a device value on the host "
                            "(session.debug_host_syncs)")
    train.add_argument("--debug", action="store_true",
                       help="print a failure's traceback, library logs and JAX's native error lines")
    cache = train.add_mutually_exclusive_group()
    cache.add_argument("--compilation_cache", metavar="CACHE_DIR",
                       help="keep compiled programs here, so that a restart does not compile them again "
                            "(default: DIR/compilation_cache, or JAX_COMPILATION_CACHE_DIR if set)")
    cache.add_argument("--no_compilation_cache", action="store_true", help="compile everything at every start")
    train.set_defaults(handler=_train, takes_overrides=True)
    return train


_ends_process = [False]  # set by `run()`: a failure's line is the process's last output


def _fail(args: argparse.Namespace, code: int, message: str, error: BaseException) -> int:
    """Ends a failed command: its traceback into the run's jaxmon-error.log (printed
    too with --debug), then one line on stderr; returns the exit code."""
    import traceback

    sys.stdout.flush()
    text = "".join(traceback.format_exception(error))
    if args.debug:
        print(text, file=sys.stderr, end="")
    workdir = getattr(args, "workdir", None)
    if code in (1, 75) and isinstance(workdir, str) and os.path.isdir(workdir):
        log = os.path.join(workdir, "jaxmon-error.log")
        try:
            with open_file(log, "a", encoding="utf-8") as file:  # a link there is refused, not written through
                file.write(f"{datetime.datetime.now().isoformat(timespec='seconds')} exit {code}\n{text}\n")
            if not args.debug and not is_full_disk(error):  # a full disk's one line says it all
                print(f"jaxmon {args.command}: the traceback is in {log} (--debug prints it here).", file=sys.stderr)
        except LinkedFileError as error:  # its target is left alone
            print(f"jaxmon {args.command}: the traceback is not kept: {error}", file=sys.stderr)
        except OSError:  # a full disk, say: the line below still says what failed
            pass
    if _ends_process[0]:  # the process ends after this line: nothing another thread writes comes after it
        _signals.write_last_line(f"jaxmon {args.command}: {message}\n")
    else:
        print(f"jaxmon {args.command}: {message}", file=sys.stderr, flush=True)
    return code


def _one_line(error: BaseException) -> str:
    """What failed, in one line: the error's type, message and notes (which hook, which step)."""
    parts = [f"{type(error).__name__}: {error}", *getattr(error, "__notes__", ())]
    return " ".join(" ".join(part.split()) for part in parts if part)


def _full_disk_line(args: argparse.Namespace, error: BaseException) -> str:
    """A full disk's one line: the error (the file it could not write and the fix, where it
    says them) and what is free on the run directory's disk, unless a failed save said it."""
    line = _one_line(error)
    failures = sys.modules.get("jaxmon._checkpoints.orbax_failures")  # a SaveError says the room itself
    workdir = getattr(args, "workdir", None)
    if (failures is not None and isinstance(error, failures.SaveError)) or not isinstance(workdir, str):
        return line
    free = free_bytes(workdir)
    room = "" if free is None else f"{size_text(free)} free "
    if str(error) != f"[Errno {getattr(error, 'errno', None)}] {getattr(error, 'strerror', None)}":
        return f"{line} ({room}on the disk of {workdir})"  # the error names its file and the fix
    return (f"{line}, writing in {workdir} ({room}on its disk): free space there and run again to resume from the "
            "newest checkpoint (or move the directory to a disk with room and resume there)")


def run() -> None:
    """The `jaxmon` program: `main()`, then exit with its code. After a failure the
    process ends at once: what Orbax's threads would still print while Python shuts
    down would come after the line that says what failed. After success it ends as
    Python would, without Python's teardown of every module (half a second of CPU once
    JAX is loaded): its threads are joined and the exit functions run (JAX's, which
    leaves the other processes of a run, Orbax's, logging's, a user's), then it ends."""
    _ends_process[0] = True
    code = main()
    if code:
        _signals.flush_std_streams()
        os._exit(code)
    join_threads, exit_functions = getattr(threading, "_shutdown", None), getattr(atexit, "_run_exitfuncs", None)
    if join_threads is None or exit_functions is None:  # another Python: its own exit, teardown and all
        sys.exit(0)
    join_threads()  # what the interpreter does first at exit: the threads not marked daemon end
    exit_functions()
    _flush_open_files()
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except (OSError, ValueError):  # as Python's own exit when it cannot flush stdout
        os._exit(120)
    os._exit(0)


def _flush_open_files() -> None:
    """Flushes every open file written through Python, and C's stdio, as Python's
    teardown would (a user's hook may leave a file open); 50 ms with JAX loaded."""
    import ctypes
    import gc
    import io

    kinds = (io.TextIOWrapper, io.BufferedWriter, io.BufferedRandom)
    for file in [obj for obj in gc.get_objects() if type(obj) in kinds]:
        try:
            if not file.closed:
                file.flush()
        except Exception:  # a broken pipe, a full disk: as the teardown, it goes on
            pass
    try:
        ctypes.CDLL(None).fflush(None)
    except (OSError, AttributeError):  # no C library to ask
        pass


def _split_overrides(argv: list[str]) -> tuple[list[str], list[str]]:
    """`--config.KEY=VALUE` (or `--config.KEY VALUE`, the absl habit) apart from the rest."""
    overrides, rest, i = [], [], 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--":  # what follows is another command's (`jaxmon launch -- ...`): left as it is
            return overrides, rest + argv[i:]
        if arg.startswith("--config.") and "=" not in arg and i + 1 < len(argv):
            overrides.append(f"{arg}={argv[i + 1]}")
            i += 2
            continue
        (overrides if arg.startswith("--config.") else rest).append(arg)
        i += 1
    return overrides, rest


def _train(args: argparse.Namespace) -> int:
    from jaxmon._experiment.config_file import load_config
    from jaxmon._experiment.keys import check_keys
    from jaxmon._experiment.trackers import writers_of
    from jaxmon._processes.local import LEVEL_NAMES, processes_option, run_processes

    if not args.debug:  # JAX's native error lines (a lost peer's, before jaxmon's one line) with --debug only
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")  # read once, when JAX loads
        os.environ.setdefault("WANDB_SILENT", "true")  # W&B's own lines (tens a run): a WandbWriter's run is named
    with _signals.loading():  # before JAX loads: a config's error is said at once; a signal ends it
        processes = processes_option(args.processes)
        config = load_config(args.config, args.overrides)
        check_keys(config)  # before JAX loads: a misspelled section or a value of another type is said at once
        writers_of(config.get("writers"), args.workdir)  # a tracker's missing package or unusable URI too
        if args.debug_host_syncs:
            config["session"] = {**config.get("session", {}), "debug_host_syncs": True}
    if processes > 1:  # the config is checked once, here; each process loads it again
        return run_processes(args.argv, processes, args.workdir)
    if not args.debug:  # Gloo's line per process and communicator, printed by its C++ (native_lines.py)
        from jaxmon._cli.native_lines import drop_native_lines

        drop_native_lines()
    with _signals.loading():
        import jax

        from jaxmon._experiment.train import train_experiment
        from jaxmon._processes.launch import connect
    log = logging.getLogger("jaxmon")
    if not log.handlers:
        handler = _ClearLineHandler()
        levels = " %(levelname)s" if os.environ.get(LEVEL_NAMES) else ""  # a launcher reads them
        handler.setFormatter(logging.Formatter(f"%(asctime)s{levels} %(message)s", "%H:%M:%S"))
        log.addHandler(handler)
        log.propagate = False  # libraries may have configured the root logger too
    log.setLevel(logging.WARNING if args.quiet else logging.INFO)
    if not args.debug:  # tracebacks go to jaxmon-error.log; Orbax's own (absl) logs only with --debug
        for handler in log.handlers:
            if isinstance(handler, _ClearLineHandler):
                handler.show_tracebacks = False
        logging.getLogger("absl").setLevel(logging.CRITICAL)
        sys.stderr = _MainThreadOnly(sys.stderr, os.path.join(args.workdir, "jaxmon-error.log"))
    elif logging.getLogger("absl").level == logging.NOTSET:  # Orbax's INFO too (`manager.ORBAX_INFO`)
        logging.getLogger("absl").setLevel(logging.INFO)
    connect()  # one of several processes (hosts): connect to the others first
    cache = False if args.no_compilation_cache else args.compilation_cache or True
    if args.no_compilation_cache:  # JAX_COMPILATION_CACHE_DIR too: this process compiles everything
        jax.config.update("jax_enable_compilation_cache", False)
    result = train_experiment(config, args.workdir, report=lambda line: print(line, flush=True),
                              compilation_cache=cache)
    if result.get("stopped") in ("SIGTERM", "SIGHUP"):  # saved and stopped: the same last line as Ctrl-C's
        signum = signal.Signals[result["stopped"]]
        raise _signals.Terminated(f"Stopped by {signum.name} at step {result['step']}", signum=signum)
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
            with open_file(self._log, "a", encoding="utf-8") as file:
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


if __name__ == "__main__":
    sys.exit(main())
