"""Reading an experiment config: its top-level keys, typed keys, and import paths."""

from __future__ import annotations

import difflib
import importlib
from collections.abc import Mapping
from typing import Any

from jaxmon._experiment.config_file import ConfigError, with_article

#: The keys an experiment config may have at its top level.
TOP_LEVEL = ("seed", "prng_impl", "steps", "data", "model", "task", "optimizer", "hooks", "session", "warm_start",
             "name", "mesh", "sharding", "perf", "writers")

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
        raise ConfigError(f"Config key {key!r} must be {with_article(kind.__name__)}; got {value!r}.")
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
