"""Experiment configs: Python files with `get_config()` (or YAML), and type-checked
command-line overrides such as `--config.optimizer.learning_rate=3e-4`."""

from __future__ import annotations

import ast
import copy
import difflib
import math
import os
import runpy
import sys
from collections.abc import Iterable, Mapping
from typing import Any

from jaxmon._base.errors import ConfigError, with_article
from jaxmon._experiment.keys import TOP_LEVEL

__all__ = ["ConfigError", "apply_overrides", "load_config"]


def load_config(path: str | os.PathLike, overrides: Iterable[str] = ()) -> dict[str, Any]:
    """Loads an experiment config and applies overrides to it.

    Args:
      path: a Python file defining `get_config()` that returns a dict (or an
        `ml_collections.ConfigDict`, or anything with `to_dict()`), or a YAML file.
        Its directory joins `sys.path`, so that modules next to it import by name
        (`data.source: "mydata:load"`).
      overrides: `"key.sub=value"` strings (a leading `--config.` is allowed); see
        `apply_overrides`.

    Returns:
      The config as plain nested dicts and lists.

    Example:
      >>> import pathlib, tempfile
      >>> path = pathlib.Path(tempfile.mkdtemp()) / "exp.py"
      >>> _ = path.write_text("def get_config():\\n    return {'optimizer': {'learning_rate': 0.1}}\\n")
      >>> load_config(path, ["--config.optimizer.learning_rate=3e-4"])
      {'optimizer': {'learning_rate': 0.0003}}
    """
    path = os.fspath(path)
    if os.path.isdir(path):
        raise ConfigError(_directory_given(path))
    if not os.path.isfile(path):
        raise ConfigError(f"No config file at {path!r}. Pass --config with the path of a Python file "
                          "defining get_config() (e.g. configs/default.py) or a YAML file.")
    size = os.path.getsize(path)
    if size > MAX_BYTES:
        raise ConfigError(f"The config file {path} is {size / 2**20:.1f} MB; a config file is at most "
                          f"{MAX_BYTES // 2**20} MB. Keep data out of it: give its path (data.source) instead.")
    directory = os.path.dirname(os.path.abspath(path))
    if directory not in sys.path:  # modules next to the config (a data loader, a model) import by name
        sys.path.append(directory)
    config = _load_yaml(path) if path.endswith((".yaml", ".yml")) else _load_python(path)
    config = _plain(config, path)
    if not isinstance(config, dict):
        raise ConfigError(f"The config of {path} must be a dict (or a ConfigDict); got {type(config).__name__}.")
    config = apply_overrides(config, overrides)
    for key, value in _leaves(config):
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"Config key {key!r} is {value!r}: a run needs a finite number there. Give a finite "
                              "float, or None to turn the setting off.")
    return config


def _directory_given(path: str) -> str:
    """What to say when the config's `path` is a directory: a run's, or one of config files."""
    try:
        names = sorted(os.listdir(path))
    except OSError:
        names = []
    if "metrics.jsonl" in names or "hparams.json" in names or any(name.isdigit() for name in names):
        return (f"--config {path!r} is a run directory, not a config file: give --config the config file the run was "
                f"trained from, and the run's directory as --workdir (`jaxmon inspect {path}` prints its config).")
    configs = [name for name in names if name.endswith((".py", ".yaml", ".yml")) and not name.startswith("_")]
    inside = f"; in it: {', '.join(configs[:8])}{', ...' if len(configs) > 8 else ''}" if configs else ""
    return (f"--config {path!r} is a directory, not a config file: give the path of a Python file defining "
            f"get_config() or of a YAML file{inside}.")


#: A config's bounds: its file's size (read whole before it is parsed), how deep it nests
#: and how many values it holds once its YAML aliases are expanded (a "billion laughs" of
#: a few hundred bytes expands to 10^9).
MAX_BYTES, MAX_DEPTH, MAX_VALUES = 10 * 2**20, 100, 1_000_000


def _load_python(path: str) -> Any:
    """Runs the Python config file `path` and calls its `get_config()`; an error in
    either names the file and the line of it where the error was raised."""
    try:
        namespace = runpy.run_path(path)
    except SyntaxError as error:
        where = f"{error.filename or path}" + (f", line {error.lineno}" if error.lineno else "")
        raise ConfigError(f"{where}: {error.msg} (the config file's Python syntax; fix that line).") from error
    except ConfigError:
        raise
    except Exception as error:
        raise ConfigError(_raised_in(path, error, "running the config file")) from error
    if not callable(namespace.get("get_config")):
        raise ConfigError(f"The config file {path} defines no get_config(); "
                          "add `def get_config(): return {...}`.")
    try:
        return namespace["get_config"]()
    except ConfigError:  # a config that loads another config: that one's error names its file
        raise
    except Exception as error:
        raise ConfigError(_raised_in(path, error, "in its get_config()")) from error


def _raised_in(path: str, error: Exception, when: str) -> str:
    """One line for an `error` raised `when` running the config `path`: the file, the
    line of it the traceback last passes through, and the error."""
    import traceback

    here = os.path.realpath(path)
    lines = [frame.lineno for frame in traceback.extract_tb(error.__traceback__)
             if frame.filename and os.path.realpath(frame.filename) == here]
    where = f"{path}, line {lines[-1]}" if lines else path
    text = " ".join(f"{type(error).__name__}: {error}".split()).rstrip(".")
    return f"{where}: {text} (raised {when}; fix the config there)."


def _load_yaml(path: str) -> Any:
    """YAML with YAML 1.2's numbers: PyYAML follows YAML 1.1, where `1e-3` (no dot) is
    a string; here it is the float a config means. A syntax error names the line; a
    file that is not UTF-8 text, nests deeper than `MAX_DEPTH` or expands through its
    aliases to more than `MAX_VALUES` values is refused before it is built."""
    import re

    import yaml

    try:
        with open(path, "rb") as file:
            data = file.read()
    except OSError as error:
        raise ConfigError(f"Cannot read the config file {path!r}: {error.strerror or error}.") from error
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ConfigError(f"{path} is not UTF-8 text (byte 0x{data[error.start]:02x} at offset {error.start}): a "
                          "YAML config is a text file; check that --config names the config.") from None

    class Loader(_BoundedComposer, yaml.SafeLoader):
        pass

    Loader.add_implicit_resolver(
        "tag:yaml.org,2002:float",
        re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
        list("-+0123456789"))
    Loader.config_path = path
    loader = None
    try:
        loader = Loader(text)  # a character YAML does not allow is an error already here
        node = loader.get_single_node()
        if node is None:
            return None
        _check_expansion(node, path, 1, {}, set())
        return loader.construct_document(node)
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f"{path}, line {mark.line + 1}, column {mark.column + 1}" if mark is not None else path
        problem = getattr(error, "problem", None) or str(error).splitlines()[0]
        context = getattr(error, "context", None)
        raise ConfigError(f"{where}: {problem}{f' ({context})' if context else ''}: the config file's YAML "
                          "syntax; fix it there.") from None
    finally:
        if loader is not None:
            loader.dispose()


class _BoundedComposer:
    """A PyYAML loader mixin whose composer refuses nesting deeper than `MAX_DEPTH`
    (PyYAML composes recursively: 5,000 levels end in a RecursionError)."""

    config_path = "the config"
    _depth = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                raise ConfigError(f"{_at(self.config_path, self.peek_event().start_mark)}: nested more than "
                                  f"{MAX_DEPTH} levels deep; a config is refused past that: flatten it.")
            return super().compose_node(parent, index)  # type: ignore[misc]
        finally:
            self._depth -= 1


def _at(path: str, mark: Any) -> str:
    return f"{path}, line {mark.line + 1}, column {mark.column + 1}"


def _check_expansion(node: Any, path: str, depth: int, seen: dict[int, tuple[int, int]],
                     open_nodes: set[int]) -> tuple[int, int]:
    """The number of values and the depth of the YAML `node` with every alias expanded
    (each node is walked once, where it is written); a `ConfigError` naming the line
    if the count passes `MAX_VALUES`, the depth `MAX_DEPTH` (named where the alias that
    passes it is written), or an alias refers to a value that holds it."""
    key = id(node)
    if key in open_nodes:
        raise ConfigError(f"{_at(path, node.start_mark)}: an alias refers to a value that holds it (a "
                          "recursive structure); a config is a tree: write the values out.")
    if key in seen:  # an alias: its parent checks the depth it brings
        return seen[key]
    children = node.value if isinstance(node.value, list) else []
    open_nodes.add(key)
    count, height = 1, 1
    for child in children:
        for part in child if isinstance(child, tuple) else (child,):  # a mapping's (key, value) pairs
            values, levels = _check_expansion(part, path, depth + 1, seen, open_nodes)
            count, height = count + values, max(height, levels + 1)
            if count > MAX_VALUES:
                raise ConfigError(
                    f"{_at(path, node.start_mark)}: this value expands to more than {MAX_VALUES:,} values "
                    "through its YAML aliases (a \"billion laughs\"); a config is refused past that: use fewer "
                    "nested aliases.")
            if depth + height - 1 > MAX_DEPTH:
                raise ConfigError(f"{_at(path, node.start_mark)}: nested more than {MAX_DEPTH} levels deep once "
                                  "its YAML aliases are expanded; a config is refused past that: flatten it.")
    open_nodes.discard(key)
    seen[key] = count, height
    return count, height


def apply_overrides(config: Mapping[str, Any], overrides: Iterable[str]) -> dict[str, Any]:
    """Returns a copy of `config` with each `"a.b.c=value"` applied.

    The value is read as a Python literal (`3e-4`, `True`, `[64, 64]`, `'adam'`); text
    that is not a literal stays a string. It must fit the type of the value it
    replaces: an int for an int, a number for a float, True/False for a bool, a string
    for a string, a list for a list; `None` fits every key (turning a setting off), and
    a key whose value is None takes any literal.
    List items are addressed by index (`hooks.0.every_n_steps=50`). A top-level key
    the config leaves out (`writers`, `mesh`, `warm_start`, ...: `keys.TOP_LEVEL`) may
    be given whole (`writers=[{'name': 'wandb'}]`). An unknown key is an error naming
    it and the nearest known one.

    Example:
      >>> apply_overrides({"steps": 100, "optimizer": {"name": "adam"}}, ["steps=200", "optimizer.name=sgd"])
      {'steps': 200, 'optimizer': {'name': 'sgd'}}
    """
    config = copy.deepcopy(dict(config))
    for override in overrides:
        text = override[len("--config."):] if override.startswith("--config.") else override
        key, equals, raw = text.partition("=")
        if not equals or not key:
            raise ConfigError(f"A config override looks like --config.key.sub=value; got {override!r}.")
        if key in TOP_LEVEL and key not in config:  # a section the config leaves out, given whole
            config[key] = _coerce(key, raw, None)
            continue
        parent, leaf = _locate(config, key.split("."))
        parent[leaf] = _coerce(key, raw, parent[leaf])
    return config


def value_at(config: Mapping[str, Any], key: str) -> Any:
    """The value of the dotted `key` in `config` (list items by index: `hooks.1.name`).

    Raises:
      ConfigError: `key` is not in `config` (naming the nearest known key).
    """
    parent, leaf = _locate(dict(config), key.split("."))
    return parent[leaf]


def _locate(config: dict, parts: list[str]) -> tuple[Any, Any]:
    node: Any = config
    for depth, part in enumerate(parts):
        here = ".".join(parts[:depth])
        if isinstance(node, dict):
            if part not in node:
                raise ConfigError(_unknown(".".join(parts), part, here, list(node), config))
            key: Any = part
        elif isinstance(node, list):
            if not (part.isdigit() and int(part) < len(node)):
                raise ConfigError(f"Unknown config key {'.'.join(parts)!r}: {here or 'the config'} is a list of "
                                  f"{len(node)} items; address one by its index 0..{len(node) - 1}.")
            key = int(part)
        else:
            raise ConfigError(f"Unknown config key {'.'.join(parts)!r}: {here!r} is {_kind(node)} ({node!r}), "
                              "which has no keys.")
        if depth == len(parts) - 1:
            return node, key
        node = node[key]
    raise ConfigError("An empty config key.")


def _unknown(full: str, part: str, here: str, siblings: list[str], config: dict) -> str:
    known = ", ".join(sorted(str(s) for s in siblings)) or "none"
    nearest = _nearest_path(full, part, here, [str(s) for s in siblings], set(_paths(config)))
    hint = f"Did you mean {nearest!r}? " if nearest else ""
    return f"Unknown config key {full!r}: {here or 'the config'} has no key {part!r}. {hint}Its keys: {known}."


def _nearest_path(full: str, part: str, here: str, siblings: list[str], paths: set[str]) -> str | None:
    """The full dotted path `full` most likely meant: the unknown `part` replaced by
    the nearest of its `siblings` (an abbreviation counts: `lr` for `learning_rate`),
    with the rest of `full` kept where that path exists; else the nearest path."""
    prefix = f"{here}." if here else ""
    rest = full[len(prefix) + len(part):]
    near = _nearest(part, siblings)
    if near is not None:
        return prefix + near + rest if prefix + near + rest in paths else prefix + near
    close = difflib.get_close_matches(full, sorted(paths), n=1, cutoff=0.6)
    return close[0] if close else None


def _nearest(part: str, names: list[str]) -> str | None:
    for name in names:  # an abbreviation: the initials of its words, or its first letters
        words = [word for word in name.split("_") if word]
        if len(part) >= 2 and (part == "".join(word[0] for word in words) or name.startswith(part)):
            return name
    close = difflib.get_close_matches(part, names, n=1, cutoff=0.5)
    return close[0] if close else None


def _paths(node: Any, prefix: str = "") -> Iterable[str]:
    if isinstance(node, dict):
        for key, value in node.items():
            yield prefix + str(key)
            yield from _paths(value, f"{prefix}{key}.")
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _paths(value, f"{prefix}{i}.")


_TRUE, _FALSE = {"true", "yes", "on"}, {"false", "no", "off"}


def _coerce(key: str, raw: str, old: Any) -> Any:
    try:
        value = ast.literal_eval(raw)
    except (ValueError, SyntaxError):
        value = raw
    if old is None or value is None:
        return value
    if isinstance(old, bool):
        if isinstance(value, bool):
            return value
        if raw.lower() in _TRUE | _FALSE:
            return raw.lower() in _TRUE
    elif isinstance(old, int):
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif isinstance(old, float):
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str) and _non_finite(raw):
            raise ConfigError(f"Config key {key!r} is a float ({old!r}); the override {raw!r} is not finite, and a "
                              f"run needs a finite number there. Pass a finite float, e.g. --config.{key}={old!r}, "
                              "or None to turn the setting off.")
    elif isinstance(old, str):
        return raw if not isinstance(value, str) else value
    elif isinstance(old, (list, tuple)):
        if isinstance(value, (list, tuple)):
            return list(value)
    elif isinstance(old, dict):
        if isinstance(value, dict):
            return value
    else:
        return value
    raise ConfigError(f"Config key {key!r} is {_kind(old)} ({old!r}); the override {raw!r} is "
                      f"{_kind(value)}. Pass {_kind(old)}, e.g. --config.{key}={old!r}.")


def _non_finite(text: str) -> bool:
    """Whether `text` spells a float that is not finite (`nan`, `inf`, `-Infinity`)."""
    try:
        return not math.isfinite(float(text))
    except ValueError:
        return False


def _leaves(node: Any, prefix: str = "") -> Iterable[tuple[str, Any]]:
    """`(dotted key, value)` of every value in `node` that is not a dict or a list."""
    if isinstance(node, dict):
        for key, value in node.items():
            yield from _leaves(value, f"{prefix}{key}.")
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _leaves(value, f"{prefix}{i}.")
    else:
        yield prefix[:-1], node


def _kind(value: Any) -> str:
    """What `value` is, in words: "text", "None", or its type's name with its article."""
    if isinstance(value, str):
        return "text"
    return "None" if value is None else with_article(type(value).__name__)


def _plain(config: Any, path: str) -> Any:
    """Plain dicts and lists from a ConfigDict, tuples or nested mappings; a
    `ConfigError` if `config` (from the file `path`) nests deeper than `MAX_DEPTH`
    (or holds itself) or holds more than `MAX_VALUES` values."""
    count = 0

    def plain(node: Any, depth: int) -> Any:
        nonlocal count
        count += 1
        if depth > MAX_DEPTH:
            raise ConfigError(f"The config of {path} is nested more than {MAX_DEPTH} levels deep (or holds "
                              "itself); a config is refused past that: flatten it.")
        if count > MAX_VALUES:
            raise ConfigError(f"The config of {path} holds more than {MAX_VALUES:,} values; a config is refused "
                              "past that: load large data in data.source instead.")
        if hasattr(node, "to_dict") and callable(node.to_dict):
            node = node.to_dict()
        if isinstance(node, Mapping):
            return {str(key): plain(value, depth + 1) for key, value in node.items()}
        if isinstance(node, (list, tuple)):
            return [plain(value, depth + 1) for value in node]
        return node

    return plain(config, 1)
