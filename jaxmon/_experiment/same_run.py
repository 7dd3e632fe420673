"""Resuming a run: the config changes since its latest checkpoint, which of them the
checkpoints depend on, and a learning rate that the resumed steps would train at 0."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from jaxmon._base.errors import ConfigError
from jaxmon._checkpoints.step_dirs import complete_steps, read_meta
from jaxmon._experiment.sections import learning_rate_of

#: What a run's checkpoints depend on: resuming with any of these changed is an error.
#: Every other `optimizer` key changes the update (a constant learning rate, the
#: optimizer's own arguments, clipping, accumulation): a resume that changed one would
#: train on as neither run.
SAME_RUN = ("seed", "task", "model", "data", "optimizer")
_NOT_SAME_RUN = ("data.eval_split", "data.eval_batch_size")
#: The arguments of a learning-rate schedule (`optimizer.learning_rate: {"name": ...}`):
#: a resume may change them (extend the decay with the steps, say). The optimizer state
#: keeps only its update count, and the new schedule goes on from it.
_SCHEDULE = "optimizer.learning_rate."


def report_changes(config: Mapping[str, Any], workdir: str, report: Callable[[str], None]) -> None:
    """Reports how `config` differs from the config of the latest complete checkpoint in
    `workdir` (see `complete_steps`), one line a change; nothing if `workdir` holds none.

    Raises:
      ConfigError: a change is one the checkpoints depend on (see `check_same_run`).
    """
    for step in reversed(complete_steps(workdir) if os.path.isdir(workdir) else []):
        saved = (read_meta(os.path.join(workdir, str(step))) or {}).get("config")
        if saved is not None:  # the newest complete checkpoint whose metadata reads
            for change in check_same_run(saved, config, workdir, step):
                report(f"Changed since step {step}: {change}")
            stalled = stalled_rate(config, step)
            if stalled:
                report(stalled)
            return


def check_same_run(saved: Any, config: Mapping[str, Any], workdir: str, step: int) -> list[str]:
    """Raises a `ConfigError` if `config` changes what the checkpoints in `workdir`
    depend on (`SAME_RUN`); returns the other changes, one line each.

    Example:
      >>> check_same_run({"steps": 10, "seed": 0}, {"steps": 20, "seed": 0}, "run", 10)
      ['steps: 10 -> 20']
    """
    if not isinstance(saved, Mapping):
        return []
    changes = _diff(saved, config, "")
    schedule = [change for change in changes if _in_schedule(change.split(":")[0])]
    changes = [change for change in changes if change not in schedule]
    breaking = [change for change in changes if _checkpoints_depend_on(change.split(":")[0])]
    if breaking:
        raise ConfigError(
            f"{workdir} holds checkpoints (latest step {step}) of a run whose config differs where the "
            f"checkpoints depend on it: {'; '.join(breaking)}. Resume with the same settings, use a new "
            f"--workdir, or warm-start a new run from this one (--config.warm_start={workdir}).")
    if schedule:
        arguments = ", ".join(change.removeprefix(_SCHEDULE).replace(":", "", 1) for change in schedule)
        changes.append(f"the learning-rate schedule ({arguments}): the run goes on with the new one from "
                       "its update count")
    return sorted(changes)


def stalled_rate(config: Mapping[str, Any], step: int) -> str | None:
    """One line when every step a run resumed at `step` trains would train at a learning
    rate of 0 (a schedule decayed to 0 before the run's new last step), else None."""
    spec, steps = config.get("optimizer"), config.get("steps")
    rate = learning_rate_of(spec) if isinstance(spec, Mapping) else None
    if rate is None or not isinstance(steps, int) or steps <= step:
        return None
    if float(np.abs(rate(step))) > 0 or float(np.abs(rate(steps - 1))) > 0:
        return None  # the first or the last update of the resumed steps moves the parameters (a step is one)
    schedule = spec["learning_rate"] if isinstance(spec["learning_rate"], Mapping) else {}
    lengths = [key for key in schedule if key.endswith("_steps")]
    fix = (f"extend the schedule with the steps, e.g. --config.{_SCHEDULE}{lengths[-1]}={steps}"
           if lengths else "give a learning rate above 0")
    return (f"The learning rate is 0 from step {step} to step {steps}: the schedule ended before the new last "
            f"step, so these steps would not change the parameters; {fix}.")


def _in_schedule(key: str) -> bool:
    """Whether `key` is an argument of a learning-rate schedule (not its name)."""
    return key.startswith(_SCHEDULE) and key != _SCHEDULE + "name"


def _checkpoints_depend_on(key: str) -> bool:
    return not key.startswith(_NOT_SAME_RUN) and any(key == k or key.startswith(k + ".") for k in SAME_RUN)


def _diff(old: Any, new: Any, key: str) -> list[str]:
    if isinstance(old, Mapping) and isinstance(new, Mapping):
        return [change for name in sorted(set(old) | set(new), key=str)
                for change in _diff(old.get(name, "<absent>"), new.get(name, "<absent>"),
                                    f"{key}.{name}" if key else str(name))]
    if isinstance(old, list) and isinstance(new, list) and len(old) == len(new):
        return [change for i, (a, b) in enumerate(zip(old, new, strict=True)) for change in _diff(a, b, f"{key}.{i}")]
    return [] if old == new else [f"{key}: {old!r} -> {new!r}"]
