"""Reading an experiment config: its top-level keys, typed keys, and import paths."""

from __future__ import annotations

import difflib
import importlib
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

from jaxmon._base.errors import ConfigError, with_article

#: The keys an experiment config may have at its top level.
TOP_LEVEL = ("seed", "prng_impl", "steps", "data", "model", "task", "optimizer", "hooks", "session", "warm_start",
             "name", "mesh", "sharding", "perf", "writers")

#: The sums a built-in task's eval metrics divide (`jm.Ratio`'s parts), by task: its step
#: outputs them too, and they stay in a run's records for whoever reads them, but `jaxmon
#: inspect`, `plot` and the sweep's table show the metrics, not their parts.
TASK_PARTS = {"lm": ("loss_sum", "tokens", "correct")}

_MISSING = object()


def check_top_level(config: Mapping[str, Any]) -> None:
    """Raises a `ConfigError` naming the first key of `config` (in sorted order) that
    is not in `TOP_LEVEL`, with the nearest known key."""
    unknown = sorted(set(config) - set(TOP_LEVEL))
    if unknown:
        raise ConfigError(_unknown_top_level(unknown[0]))


def _unknown_top_level(key: str) -> str:
    near = difflib.get_close_matches(key, TOP_LEVEL, n=1)
    return (f"Unknown config key {key!r}." + (f" Did you mean {near[0]!r}?" if near else "")
            + f" An experiment config has: {', '.join(TOP_LEVEL)}.")


class Kind(NamedTuple):
    """What a config key takes: the values `accepts` says yes to, said as `words` ("an int")."""

    accepts: Callable[[Any], bool]
    words: str

    def or_none(self) -> Kind:
        """This kind, or None (the setting off)."""
        return Kind(lambda value: value is None or self.accepts(value), f"{self.words} or None")


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


INT = Kind(lambda value: isinstance(value, int) and not isinstance(value, bool), "an int")
NUMBER = Kind(_number, "a number")
TEXT = Kind(lambda value: isinstance(value, str), "a string")
FLAG = Kind(lambda value: isinstance(value, bool), "True or False")
DICT = Kind(lambda value: isinstance(value, Mapping), "a dict")
LIST = Kind(lambda value: isinstance(value, list), "a list")
_RATE = Kind(lambda value: _number(value) or isinstance(value, Mapping) or callable(value),
             "a number or a schedule ({'name': <an optax schedule>, ...its arguments})")

#: The kind of each key that jaxmon reads itself, by its dotted name. The others are
#: checked by what takes them: a model's keys by the model, a hook's by the hook, the
#: session's by its arguments' types (`sections.session_args_of`), an import path
#: (data.source, model.name, a hook's name) where it is imported.
KINDS = {
    "name": TEXT.or_none(), "seed": INT, "prng_impl": TEXT, "steps": INT, "task": TEXT,
    "data": DICT, "model": DICT.or_none(), "optimizer": DICT.or_none(), "hooks": LIST, "session": DICT,
    "perf": DICT, "writers": LIST.or_none(),
    "data.batch_size": INT, "data.eval_split": TEXT, "data.eval_batch_size": INT.or_none(), "data.loader": TEXT,
    "data.worker_count": INT, "data.pad_id": INT.or_none(),
    "optimizer.name": TEXT, "optimizer.learning_rate": _RATE, "optimizer.clip_global_norm": NUMBER.or_none(),
    "optimizer.accumulate_steps": INT, "optimizer.weight_decay_mask": TEXT,
    "perf.every_n_steps": INT.or_none(), "perf.peak_tflops": NUMBER.or_none(),
    "perf.flops_per_step": NUMBER.or_none(), "perf.examples_per_step": NUMBER.or_none(),
    "perf.tokens_per_step": NUMBER.or_none(),
}


def check_keys(config: Mapping[str, Any]) -> None:
    """Raises a `ConfigError` for the first unknown top-level key of `config` (see
    `check_top_level`), else for the first key of `KINDS` whose value is of another kind.

    Example:
      >>> check_keys({"steps": 10, "data": {"batch_size": [64]}})
      Traceback (most recent call last):
      jaxmon._base.errors.ConfigError: Config key 'data.batch_size' must be an int, got a list ([64]); ...
    """
    check_top_level(config)
    for key, kind in KINDS.items():
        section, _, name = key.rpartition(".")
        parent = config.get(section) if section else config
        if isinstance(parent, Mapping) and name in parent:
            check_kind(key, parent[name], kind)


def check_kind(key: str, value: Any, kind: Kind) -> None:
    """Raises a `ConfigError` naming `key`, `kind` and what `value` is, unless `kind` accepts it."""
    if not kind.accepts(value):
        _refuse(key, value, kind.words)


def _refuse(key: str, value: Any, wanted: str) -> None:
    if value is None:
        got = "None"
    else:
        got = f"{with_article('string' if isinstance(value, str) else type(value).__name__)} ({value!r:.80})"
    raise ConfigError(f"Config key {key!r} must be {wanted}, got {got}; fix it in the config (configs/default.py "
                      "shows each key).")


def get_key(config: Mapping[str, Any], key: str, kind: type, default: Any = _MISSING) -> Any:
    """The value of `key` in `config`, checked to be a `kind`.

    Args:
      config: the experiment config.
      key: a top-level key.
      kind: the type the value must have (`int` excludes `bool`).
      default: the value when `key` is absent; without it, `key` is required.

    Raises:
      ConfigError: `key` is absent and has no default, or its value is not a `kind`.
    """
    if key not in config:
        if default is _MISSING:
            raise ConfigError(f"The experiment config needs {key!r} ({with_article(kind.__name__)}); see "
                              "configs/default.py.")
        return default
    value = config[key]
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        _refuse(key, value, with_article(kind.__name__))
    return value


def pop_key(section: dict[str, Any], name: str, key: str) -> Any:
    """Removes the required `name` from `section` and returns its value; `key` is its
    full name in errors (e.g. "data.source")."""
    if name not in section:
        raise ConfigError(f"The experiment config needs {key!r}; see configs/default.py.")
    return section.pop(name)


def resolve(path: Any, key: str) -> Any:
    """The object at an import path: "pkg.mod:attr" or "pkg.mod.attr".

    Args:
      path: the import path.
      key: the config key that holds it, named in errors.

    Raises:
      ConfigError: `path` is not a string, its module cannot be imported, or the
        module lacks the attribute (the error suggests a near name).

    Example:
      >>> resolve("jaxmon.models:MLP", "model.name").__name__
      'MLP'
    """
    if not isinstance(path, str) or not path:
        raise ConfigError(f"{key} must be an import path such as 'jaxmon.models:MLP'; got {path!r}.")
    module_name, _, attr = path.partition(":") if ":" in path else path.rpartition(".")
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise ConfigError(f"{key}={path!r}: cannot import {module_name!r} ({error}).") from error
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            public = [n for n in dir(obj) if not n.startswith("_")]
            near = difflib.get_close_matches(part, public, n=1)
            raise ConfigError(f"{key}={path!r}: {module_name} has no {attr!r}."
                              + (f" Did you mean {module_name}:{near[0]}?" if near else ""))
        obj = getattr(obj, part)
    return obj
