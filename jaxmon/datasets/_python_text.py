"""Python's own standard-library sources as packed rows of byte tokens, for language models."""

from __future__ import annotations

import functools
import importlib
import inspect
import pathlib
from collections.abc import Sequence

import numpy as np

#: The number of token ids `python_text` uses: ASCII codes 1..127, and 0 for padding.
PYTHON_TEXT_VOCAB = 128

#: The modules whose sources `python_text` reads by default (~214,000 characters).
DEFAULT_MODULES = ("textwrap", "heapq", "functools", "contextlib", "fractions", "queue", "shlex", "collections")

_SPLITS = ("train", "test", "validation")


@functools.cache
def _stream(modules: tuple[str, ...]) -> np.ndarray:
    """The modules' sources joined by newlines, as uint8 ASCII codes 1..127
    (other characters, NUL included, become "?")."""
    sources = []
    for name in modules:
        try:
            module = importlib.import_module(name)
        except ImportError as error:
            raise ValueError(f"python_text: cannot import module {name!r} ({error}); give the names of "
                             "importable modules, e.g. 'textwrap'.") from error
        try:
            path = inspect.getsourcefile(module)
        except TypeError:  # a module built into the interpreter
            path = None
        if path is None:
            raise ValueError(f"python_text: module {name!r} has no Python source file; give modules written "
                             "in Python, e.g. 'textwrap'.")
        sources.append(pathlib.Path(path).read_text(encoding="utf-8"))
    tokens = np.frombuffer("\n".join(sources).encode("ascii", errors="replace"), np.uint8).copy()
    tokens[tokens == 0] = ord("?")
    tokens.flags.writeable = False
    return tokens


def _pack(stream: np.ndarray, row_length: int) -> np.ndarray:
    """`stream` cut into non-overlapping rows of `row_length`, the last padded with 0
    (and left out if it holds a single token: no targets)."""
    rows = -(-len(stream) // row_length)
    if len(stream) % row_length == 1:
        rows -= 1
    packed = np.zeros(rows * row_length, np.int32)
    packed[:min(len(stream), len(packed))] = stream[:len(packed)]
    return packed.reshape(rows, row_length)


def python_text(split: str = "train", *, seq_len: int = 128, test_fraction: float = 0.1,
                modules: Sequence[str] = DEFAULT_MODULES) -> dict[str, np.ndarray]:
    """Standard-library Python sources for next-character prediction, packed.

    The sources of `modules` (found with `inspect.getsourcefile`: nothing is
    downloaded) form one stream of ASCII codes (1..127; characters outside ASCII
    become "?"). Its first `1 - test_fraction` is the "train" split, the rest the
    "test" split. A split's stream is cut into non-overlapping rows of `seq_len + 1`
    tokens, each row giving the inputs `row[:-1]` and the targets `row[1:]`; the last
    row is padded with 0, the padding id, which never occurs in text (mask targets
    `y == 0` out of the loss).

    Args:
      split: "train", or "test" (also called "validation").
      seq_len: the tokens per row of `x` and `y`.
      test_fraction: the share of the stream in the test split (its end).
      modules: the names of the modules whose sources make the text, in order.

    Returns:
      `{"x": int32[N, seq_len], "y": int32[N, seq_len]}`, ids in `[0, PYTHON_TEXT_VOCAB)`.

    Example:
      >>> from jaxmon.datasets import python_text
      >>> test = python_text("test", seq_len=32)
      >>> test["x"].shape[1], test["x"].dtype
      (32, dtype('int32'))
      >>> bool((test["x"][0, 1:] == test["y"][0, :-1]).all())
      True
    """
    if split not in _SPLITS:
        raise ValueError(f"python_text split must be 'train', 'test' or 'validation'; got {split!r}.")
    if not isinstance(seq_len, int) or isinstance(seq_len, bool) or seq_len < 1:
        raise ValueError(f"python_text seq_len must be a positive int; got {seq_len!r}.")
    if not 0 < test_fraction < 1:
        raise ValueError(f"python_text test_fraction must be between 0 and 1; got {test_fraction!r}.")
    if isinstance(modules, str):
        raise ValueError(f"python_text modules must be a sequence of module names; got the string {modules!r} "
                         f"(write [{modules!r}]).")
    stream = _stream(tuple(modules))
    cut = round(len(stream) * (1 - test_fraction))
    rows = _pack(stream[:cut] if split == "train" else stream[cut:], seq_len + 1)
    return {"x": np.ascontiguousarray(rows[:, :-1]), "y": np.ascontiguousarray(rows[:, 1:])}


def unigram_entropy(tokens: np.ndarray) -> float:
    """The entropy, in nats, of the frequencies of the non-zero ids in `tokens`: the
    loss of the best model that ignores context.

    Args:
      tokens: an int array of any shape; 0 (padding) is left out.

    Returns:
      `-sum(p * log(p))` over the ids' frequencies `p`.

    Example:
      >>> import numpy as np
      >>> round(unigram_entropy(np.array([[1, 2, 0], [3, 4, 0]])), 4)  # 4 ids, equally often: log 4
      1.3863
    """
    tokens = np.asarray(tokens).ravel()
    if not np.issubdtype(tokens.dtype, np.integer) or (tokens < 0).any():
        raise ValueError(f"unigram_entropy takes non-negative int token ids; got dtype {tokens.dtype}"
                         + (f" with minimum {tokens.min()}." if tokens.size else "."))
    counts = np.bincount(tokens)[1:].astype(np.float64)
    if counts.sum() == 0:
        raise ValueError("unigram_entropy got no non-zero token ids (0 is padding); give tokens of some text.")
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())
