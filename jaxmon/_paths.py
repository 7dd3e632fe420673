"""Names of pytree leaves: a `jax.tree_util` key path as "a/b/c", and nested dicts
flattened by their keys' paths."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax

#: The field that names a key path entry: `DictKey.key`, `FlattenedIndexKey.key`,
#: `GetAttrKey.name`, `SequenceKey.idx`, and the same fields of custom key classes.
_FIELDS = ("key", "name", "idx")


def path_name(path: tuple) -> str:
    """A key path as "a/b/c": each entry's key, attribute name or index, joined by "/".

    An entry without a `key`, `name` or `idx` field is written as `str(entry)`; the
    empty path is "".

    Example:
      >>> [path_name(path) for path, _ in jax.tree_util.tree_leaves_with_path({"w": [1, 2]})]
      ['w/0', 'w/1']
    """
    return "/".join(_entry_name(entry) for entry in path)


def _entry_name(entry: Any) -> str:
    for field in _FIELDS:
        if hasattr(entry, field):
            return str(getattr(entry, field))
    return str(entry)


def by_path(tag: str, tree: Any) -> dict[str, Any]:
    """The leaves of `tree`, named `tag/path/to/leaf` (just `tag` for a tree that is a leaf).

    Example:
      >>> by_path("params", {"dense": {"b": 0.0, "w": 1.0}})
      {'params/dense/b': 0.0, 'params/dense/w': 1.0}
      >>> by_path("loss", 0.5)
      {'loss': 0.5}
    """
    return {f"{tag}/{path_name(path)}" if path else tag: leaf
            for path, leaf in jax.tree_util.tree_leaves_with_path(tree)}


def flatten(tree: Mapping[str, Any], separator: str = "/", prefix: str = "") -> dict[str, Any]:
    """Every value of nested dicts `tree` that is not a dict, by its keys joined with
    `separator`.

    Example:
      >>> flatten({"loss": 1.0, "grads": {"w": 2.0}})
      {'loss': 1.0, 'grads/w': 2.0}
    """
    flat = {}
    for key, value in tree.items():
        if isinstance(value, Mapping):
            flat.update(flatten(value, separator, f"{prefix}{key}{separator}"))
        else:
            flat[f"{prefix}{key}"] = value
    return flat
