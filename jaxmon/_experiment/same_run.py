"""Resuming a run: the config changes since its latest checkpoint, and which of them
the checkpoints depend on."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any

from jaxmon._base.errors import ConfigError
from jaxmon._checkpoints.step_dirs import complete_steps, read_meta

#: What a run's checkpoints depend on: resuming with any of these changed is an error.
#: Every `optimizer` key changes the update (the learning rate and its schedule, the
#: optimizer's own arguments, clipping, accumulation): a resume that changed one would
#: train on as neither run.
SAME_RUN = ("seed", "task", "model", "data", "optimizer")
_NOT_SAME_RUN = ("data.eval_split", "data.eval_batch_size")


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
    breaking = [change for change in changes if _checkpoints_depend_on(change.split(":")[0])]
    if breaking:
        raise ConfigError(
            f"{workdir} holds checkpoints (latest step {step}) of a run whose config differs where the "
            f"checkpoints depend on it: {'; '.join(breaking)}. Resume with the same settings, use a new "
            f"--workdir, or warm-start a new run from this one (--config.warm_start={workdir}).")
    return changes


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
