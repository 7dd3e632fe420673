"""Small datasets shipped with jaxmon, for examples and tests that must work offline:
`digits` (images, 10 classes) and `python_text` (standard-library sources as packed
rows of byte tokens, for a character language model).

Example:
  >>> import jaxmon as jm
  >>> train = jm.datasets.digits("train")
  >>> train["x"].shape, train["x"].dtype, train["y"].dtype
  ((1438, 8, 8, 1), dtype('float32'), dtype('int32'))
"""

from __future__ import annotations

import functools
import gzip
import pathlib

import numpy as np

from jaxmon.datasets._python_text import PYTHON_TEXT_VOCAB, python_text, unigram_entropy

_HERE = pathlib.Path(__file__).parent

__all__ = ["PYTHON_TEXT_VOCAB", "digits", "python_text", "unigram_entropy"]


@functools.cache
def _digits_table() -> np.ndarray:
    with gzip.open(_HERE / "digits.csv.gz", "rt") as file:
        return np.loadtxt(file, delimiter=",", dtype=np.int64)


def digits(split: str = "train", *, test_fraction: float = 0.2, seed: int = 0) -> dict[str, np.ndarray]:
    """The UCI hand-written digits (1797 images of 8x8 pixels, 10 classes; CC BY 4.0,
    see `DIGITS_LICENSE.txt` next to this file), split into train and test at random.

    Args:
      split: "train", "test" or "all".
      test_fraction: the share of images in the test split.
      seed: the seed of the split (the same seed always gives the same split).

    Returns:
      `{"x": float32[N, 8, 8, 1] in [0, 1], "y": int32[N]}`.
    """
    if split not in ("train", "test", "all"):
        raise ValueError(f"digits split must be 'train', 'test' or 'all'; got {split!r}.")
    if not 0 < test_fraction < 1:
        raise ValueError(f"digits test_fraction must be between 0 and 1; got {test_fraction!r}.")
    table = _digits_table()
    order = np.random.default_rng(seed).permutation(len(table))
    n_test = round(len(table) * test_fraction)
    rows = {"train": order[n_test:], "test": order[:n_test], "all": np.arange(len(table))}[split]
    x = (table[rows, :64] / 16.0).astype(np.float32).reshape(-1, 8, 8, 1)
    return {"x": x, "y": table[rows, 64].astype(np.int32)}
