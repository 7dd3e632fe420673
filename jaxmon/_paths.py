"""Names of pytree leaves: a `jax.tree_util` key path as "a/b/c"."""

from __future__ import annotations

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
