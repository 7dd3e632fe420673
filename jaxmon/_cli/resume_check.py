"""`jaxmon check --resume`: proof, on the user's own config, that a run cut by SIGKILL
and resumed is the run that was never cut.

It trains the config for a few steps three times, each a real `jaxmon train` process:
once whole; once held after its middle checkpoint (`HoldAfterCheckpoint`) and killed
there with SIGKILL, as a lost machine would end it; and once more in that directory,
resuming. Then it compares the final checkpoints' state, every value of `metrics.jsonl`
(but the timings) and the checkpoints kept, and prints one line per difference, or that
there is none. A data iterator without a position is said in one line, with what follows
from it.
"""

from __future__ import annotations

import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from typing import Any

from jaxmon._base.hook import Hook

#: The environment variable that arms `HoldAfterCheckpoint` in the run to be cut: the step
#: of the checkpoint to hold after.
HOLD_AFTER = "JAXMON_CHECK_HOLD_AFTER"
#: The file the held run leaves in its directory once it holds.
HELD = "jaxmon-check-held"
#: The longest a held run waits for its SIGKILL before it ends itself.
_HOLD_SECS = 600.0
#: metrics.jsonl tags that time the run (never the same twice), left out of the comparison.
_TIMED = ("goodput/", "perf/", "stragglers/", "global_step/sec", "examples/sec")
_REL = 1e-6
#: How close the states must be when the resume ran on another number of processes.
_STATE_REL = 1e-5


class HoldAfterCheckpoint(Hook):
    """The resume check's hook: in a fresh run whose environment sets `HOLD_AFTER` to a
    step, holds the loop (on every process) once that step's checkpoint is complete,
    until the check ends the process with SIGKILL; does nothing otherwise."""

    def __init__(self, output_dir: str | None = None):
        self.output_dir = output_dir
        self._hold: int | None = None

    def after_create_session(self, session) -> None:
        hold = os.environ.get(HOLD_AFTER)
        self._hold = int(hold) if hold and session.restored_step is None and self.output_dir else None

    def after_run(self, ctx, values) -> None:
        from jaxmon._checkpoints.step_dirs import complete_steps

        if self._hold is None or values.step <= self._hold:
            return
        deadline = time.monotonic() + _HOLD_SECS
        while self._hold not in complete_steps(self.output_dir) and time.monotonic() < deadline:
            time.sleep(0.05)  # the save goes on in the background: the steps after it wait
        with open(os.path.join(self.output_dir, HELD), "w") as file:
            file.write(f"held after step {values.step}\n")
        time.sleep(max(0.0, deadline - time.monotonic()))
        os._exit(3)  # the check never came: end without a save


def check_resume(config_path: str, overrides: Sequence[str], *, steps: int, processes: int = 1,
                 resume_processes: int | None = None, workdir: str | None = None) -> int:
    """Runs the check (see the module's docstring); prints its lines; returns 0 when the
    resumed run is the whole one, else 1.

    Raises:
      ConfigError: the config, `steps` or the process counts are refused.
    """
    from jaxmon._base.errors import ConfigError
    from jaxmon._experiment.config_file import load_config
    from jaxmon._experiment.keys import check_keys

    if steps < 2:
        raise ConfigError(f"--steps {steps}: the check cuts the run at a checkpoint between its first and last "
                          "step; give 2 or more.")
    config = load_config(config_path, overrides)
    check_keys(config)
    cut_at = steps // 2
    config["steps"] = steps
    config["session"] = {**(config.get("session") or {}), "save_checkpoint_steps": cut_at,
                         "save_checkpoint_secs": None}
    config["hooks"] = [*(config.get("hooks") or []), {"name": f"{__name__}:HoldAfterCheckpoint"}]
    root = workdir or tempfile.mkdtemp(prefix="jaxmon-check-resume-")
    try:  # a directory of its own is removed however the check ends (a failure, Ctrl-C)
        return _check_in(root, config, config_path, steps=steps, cut_at=cut_at, processes=processes,
                         resumed_on=resume_processes or processes, kept=workdir is not None)
    finally:
        if workdir is None:
            shutil.rmtree(root, ignore_errors=True)


def _check_in(root: str, config: dict[str, Any], config_path: str, *, steps: int, cut_at: int, processes: int,
              resumed_on: int, kept: bool) -> int:
    """`check_resume` in the directory `root`: the user's (`kept`), or one removed after."""
    os.makedirs(root, exist_ok=True)
    path = os.path.join(root, "config.py")
    with open(path, "w", encoding="utf-8") as file:
        file.write(f"def get_config():\n    return {config!r}\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [os.path.dirname(os.path.abspath(config_path)),
                                                                     os.environ.get("PYTHONPATH")]))}
    whole, cut = os.path.join(root, "whole"), os.path.join(root, "cut")
    where = root if kept else f"{root} (removed at the end; --workdir DIR keeps the runs)"
    print(f"jaxmon check --resume: {steps} steps of {config_path} in {where}: whole, then cut by SIGKILL after "
          f"checkpoint {cut_at} and resumed" + (f" on {resumed_on} process{'es' if resumed_on > 1 else ''}"
                                                 if resumed_on != processes else ""),
          flush=True)
    _train(path, whole, processes, env, "the whole run")
    _train_and_kill(path, cut, processes, {**env, HOLD_AFTER: str(cut_at)}, cut_at)
    _train(path, cut, resumed_on, env, "the resumed run")
    exact = resumed_on == processes  # else the gradients are summed in another order: float32 rounding differs
    lines = differences(whole, cut, steps, cut_at, exact=exact)
    for line in lines:
        print(line, flush=True)
    if not lines:
        how = "bit for bit" if exact else (f"to rel. {_STATE_REL:g}: on another number of processes the gradients are "
                                           "summed in another order")
        print(f"No difference: the state of step {steps} ({how}), every metrics.jsonl value (rel. {_REL:g}; timings "
              "aside) and the checkpoints kept are the whole run's.", flush=True)
    return 1 if lines else 0


def _command(path: str, workdir: str, processes: int) -> list[str]:
    return [sys.executable, "-m", "jaxmon", "train", "--config", path, "--workdir", workdir, "--quiet",
            *(["--processes", str(processes)] if processes > 1 else [])]


def _train(path: str, workdir: str, processes: int, env: Mapping[str, str], what: str) -> None:
    """Trains in `workdir` to the end; every process of it is killed if the check stops first."""
    from jaxmon._base.errors import ConfigError

    process = subprocess.Popen(_command(path, workdir, processes), env=env, stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        _, stderr = process.communicate()
    finally:
        if process.returncode is None:  # the check stopped (Ctrl-C): its runs stop too, before their directory goes
            _kill_tree(process.pid)
            process.wait()
    if process.returncode:
        raise ConfigError(f"{what} failed with exit code {process.returncode} ({workdir}): {_last_line(stderr)}")


def _train_and_kill(path: str, workdir: str, processes: int, env: Mapping[str, str], cut_at: int) -> None:
    """Trains in `workdir` until the run holds after checkpoint `cut_at`, then SIGKILLs every process of it."""
    from jaxmon._base.errors import ConfigError

    process = subprocess.Popen(_command(path, workdir, processes), env=env, stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + _HOLD_SECS
        while not os.path.exists(os.path.join(workdir, HELD)):
            if process.poll() is not None:
                raise ConfigError(f"the run to cut ended (exit code {process.returncode}) before checkpoint {cut_at} "
                                  f"was complete ({workdir}): {_last_line(process.stderr.read())}")
            if time.monotonic() > deadline:
                raise ConfigError(f"the run to cut did not complete checkpoint {cut_at} in {_HOLD_SECS:.0f} s.")
            time.sleep(0.05)
    finally:
        _kill_tree(process.pid)
        process.wait()
        process.stderr.close()


def _last_line(output: str) -> str:
    """The last line a failed run printed (its one line saying why)."""
    return (output.strip().splitlines() or ["(no output)"])[-1]


def _kill_tree(pid: int) -> None:
    """SIGKILLs process `pid` and every process below it (the launcher's children first)."""
    for child in _children(pid):
        _kill_tree(child)
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as file:
            return [int(child) for child in file.read().split()]
    except OSError:  # gone, or not Linux: the process group is killed instead
        return []


def differences(whole: str, cut: str, steps: int, cut_at: int, exact: bool = True) -> list[str]:
    """One line per difference between the whole run in `whole` and the cut and resumed
    one in `cut` (the state bit for bit if `exact`, else to rel. `_STATE_REL`); with data
    that has no position, that line and a count of what follows."""
    from jaxmon._checkpoints.step_dirs import complete_steps, read_meta

    records = _record_differences(whole, cut)
    found = _state_differences(whole, cut, steps, exact) + [line for _, line in records]
    kept = (complete_steps(whole), complete_steps(cut))
    if kept[0] != kept[1]:
        found.append(f"checkpoints kept: steps {kept[1]}, where the whole run kept {kept[0]}")
    first = min((step for step, _ in records if step is not None), default=None)
    if first is not None and first <= cut_at:  # up to the cut, both runs were the same run: nothing was resumed yet
        return [*found, _not_deterministic(first, cut_at, len(found))]
    meta = read_meta(os.path.join(cut, str(cut_at))) or {}
    if meta.get("data") is None and meta.get("data_by_process") is None:
        line = (f"data: the training data has no position (its iterator has no get_state()/set_state()), so the "
                f"resumed run read other batches from step {cut_at + 1} on than the whole run; give it one "
                "(jm.ArrayDataSource, grain, or jm.ResumableIterator around your loader)")
        return [line + (f"; following from it, {len(found)} other values differ" if found else "")]
    return found


def _not_deterministic(first: int, cut_at: int, count: int) -> str:
    """The line that says why runs differ from `first`, a step before the cut at `cut_at`."""
    return (f"not deterministic: the runs differ from step {first} on, before the cut at checkpoint {cut_at}, where "
            "both ran alike: the data or the init draws random numbers without a seed. Seed them from the config: "
            "`seed` seeds the init and the data's shuffle; a data.source of your own gets the data section's other "
            "keys as arguments (give it a data.seed, as jaxmon.datasets.digits takes one), a task of your own has "
            "context.seed; " + ("the difference above follows" if count == 1 else
                                 f"the {count} differences above follow") + " from it")


def _state_differences(whole: str, cut: str, steps: int, exact: bool) -> list[str]:
    import jax
    import numpy as np

    from jaxmon._checkpoints.manager import restore_checkpoint

    a, b = restore_checkpoint(whole, step=steps), restore_checkpoint(cut, step=steps)
    leaves_a = dict(jax.tree_util.tree_flatten_with_path(a.state)[0])
    leaves_b = dict(jax.tree_util.tree_flatten_with_path(b.state)[0])
    lines = []
    for key in sorted(set(leaves_a) | set(leaves_b), key=jax.tree_util.keystr):
        name = jax.tree_util.keystr(key)
        if key not in leaves_a or key not in leaves_b:
            lines.append(f"state {name}: only in the {'resumed' if key in leaves_b else 'whole'} run")
            continue
        x, y = np.asarray(leaves_a[key]), np.asarray(leaves_b[key])
        if x.shape != y.shape or x.dtype != y.dtype:
            lines.append(f"state {name}: {y.dtype}{list(y.shape)} resumed, {x.dtype}{list(x.shape)} whole")
        elif not (np.array_equal(x, y, equal_nan=True) if exact or x.dtype.kind != "f" else
                  np.allclose(x, y, rtol=_STATE_REL, atol=_STATE_REL * float(np.max(np.abs(x), initial=0.0)))):
            delta = np.max(np.abs(x.astype(np.float64) - y.astype(np.float64))) if x.dtype.kind in "fiu" else None
            lines.append(f"state {name} at step {steps} differs" + ("" if delta is None else
                                                                    f" (largest difference {delta:.3g})"))
    return lines


def _record_differences(whole: str, cut: str) -> list[tuple[int | None, str]]:
    """A line for each metrics.jsonl value that differs between the two runs, with its step
    where both runs wrote it (None where one of them did: a hook may write at a resume)."""
    a, b = _points(whole), _points(cut)
    lines: list[tuple[int | None, str]] = []
    for key in sorted(set(a) | set(b)):
        step, tag = key
        if key not in a or key not in b:
            lines.append((None, f"metrics.jsonl {tag} at step {step}: only in the "
                                f"{'resumed' if key in b else 'whole'} run"))
        elif not _same(a[key], b[key]):
            lines.append((step, f"metrics.jsonl {tag} at step {step}: {_shown(b[key])} resumed, {_shown(a[key])} "
                                "whole"))
    return lines


def _points(workdir: str) -> dict[tuple[int, str], Any]:
    """Every (step, tag) -> value of `workdir`'s metrics.jsonl, but the timings."""
    from jaxmon._cli.runs import records

    return {(record["step"], tag): value for record in records(os.path.join(workdir, "metrics.jsonl"))
            for tag, value in record.items() if tag not in ("step", "wall_time") and not tag.startswith(_TIMED)}


def _same(x: Any, y: Any) -> bool:
    if isinstance(x, (int, float)) and isinstance(y, (int, float)):
        return math.isclose(x, y, rel_tol=_REL, abs_tol=1e-12) or (math.isnan(x) and math.isnan(y))
    return x == y


def _shown(value: Any) -> str:
    return f"{value:.7g}" if isinstance(value, float) else repr(value)[:80]
