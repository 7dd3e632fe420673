"""`jaxmon.datasets.python_text`, the standard library's sources packed into shifted rows
of byte tokens, and `unigram_entropy`, the loss of a model that ignores context."""

import inspect
import math
import pathlib

import numpy as np
import pytest

from jaxmon.datasets import PYTHON_TEXT_VOCAB, python_text, unigram_entropy

MODULES = ("heapq", "textwrap")  # ~43,000 characters


def source_stream(modules=MODULES) -> np.ndarray:
    """The modules' sources, read here, as the ASCII codes python_text should give."""
    text = "\n".join(pathlib.Path(inspect.getsourcefile(__import__(name))).read_text(encoding="utf-8")
                     for name in modules)
    return np.array([ord(c) if 0 < ord(c) < 128 else ord("?") for c in text], np.int32)


def unpack(split: dict[str, np.ndarray]) -> np.ndarray:
    """The stream of a split back from its rows: each row's first input, then its targets; padding dropped."""
    rows = np.concatenate([split["x"][:, :1], split["y"]], axis=1).ravel()
    return rows[rows != 0]


def test_python_text_is_the_sources_packed_into_shifted_rows():
    train = python_text("train", seq_len=16, test_fraction=0.25, modules=MODULES)
    test = python_text("test", seq_len=16, test_fraction=0.25, modules=MODULES)
    stream = source_stream()
    cut = round(len(stream) * 0.75)
    np.testing.assert_array_equal(unpack(train), stream[:cut])  # train: the start of the stream
    np.testing.assert_array_equal(unpack(test), stream[cut:])  # test: the rest, in order, no overlap
    for split in (train, test):
        assert split["x"].dtype == split["y"].dtype == np.int32
        assert split["x"].shape == split["y"].shape and split["x"].shape[1] == 16
        np.testing.assert_array_equal(split["x"][:, 1:], split["y"][:, :-1])  # y is x shifted by one
        assert (split["y"][:-1] != 0).all() and (split["x"][:-1] != 0).all()  # every row full but the last
        assert split["y"][-1, 0] != 0 and split["y"].max() < PYTHON_TEXT_VOCAB
    assert len(train["x"]) == math.ceil(cut / 17) or len(train["x"]) == cut // 17  # a 1-token rest makes no row


def test_python_text_is_deterministic_and_validation_is_test():
    first = python_text("validation", seq_len=32, modules=MODULES)
    second = python_text("test", seq_len=32, modules=list(MODULES))  # a config's list works too
    for key in ("x", "y"):
        np.testing.assert_array_equal(first[key], second[key])
    default = python_text("test", seq_len=128)
    assert default["x"].shape[1] == 128 and len(default["x"]) > 100  # the default modules: ~21,000 test chars


def test_python_text_replaces_non_ascii_and_pads_with_zero():
    stream = source_stream(("shlex",))  # holds non-ASCII letters
    rows = python_text("train", seq_len=1000, test_fraction=0.01, modules=("shlex",))
    assert (stream == ord("?")).sum() > 50
    np.testing.assert_array_equal(unpack(rows), stream[:round(len(stream) * 0.99)])
    last = rows["y"][-1]
    real = int((last != 0).sum())
    assert 0 < real < 1000 and (last[real:] == 0).all()


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"split": "dev"}, r"split must be 'train', 'test' or 'validation'; got 'dev'"),
    ({"seq_len": 0}, "seq_len must be a positive int; got 0"),
    ({"test_fraction": 1.0}, "test_fraction must be between 0 and 1; got 1.0"),
    ({"modules": "textwrap"}, r"modules must be a sequence of module names; got the string 'textwrap'"),
    ({"modules": ("sys",)}, "module 'sys' has no Python source file"),
    ({"modules": ("no_such_module_here",)}, "cannot import module 'no_such_module_here'"),
])
def test_python_text_errors_name_the_value(kwargs, message):
    with pytest.raises(ValueError, match=message):
        python_text(**{"split": "train", **kwargs})


def test_unigram_entropy_of_known_distributions():
    assert unigram_entropy(np.array([5, 5, 5])) == 0.0
    assert unigram_entropy(np.array([[1, 2], [0, 0]])) == pytest.approx(math.log(2))  # padding left out
    assert unigram_entropy(np.array([3, 3, 7, 9, 0])) == pytest.approx(1.5 * math.log(2))  # p = 1/2, 1/4, 1/4
    text = python_text("train", seq_len=64, modules=MODULES)["y"]
    assert 2.5 < unigram_entropy(text) < math.log(PYTHON_TEXT_VOCAB - 1)
    with pytest.raises(ValueError, match="no non-zero token ids"):
        unigram_entropy(np.zeros(4, np.int32))
    with pytest.raises(ValueError, match="non-negative int token ids; got dtype float"):
        unigram_entropy(np.array([1.0, 2.0]))
