"""The parts a config builds: a train split that `data.source` gives as batches of its own
(a plain generator, or an iterator with a position) loses none of them to the look at its
first rows."""

import numpy as np
import pytest

import jaxmon as jm
from jaxmon._experiment.parts import _train_split


def numbered(count):
    return ({"x": np.full((2, 3), i, np.float32)} for i in range(count))


def test_a_generator_s_first_batch_is_looked_at_and_still_trained_on():
    train, first = _train_split(numbered(3))
    assert first["x"][0, 0] == 0
    assert [int(batch["x"][0, 0]) for batch in train] == [0, 1, 2]


def test_an_iterator_with_a_position_is_set_back_and_keeps_its_position_protocol():
    source = jm.ResumableIterator(list(numbered(3)))
    train, first = _train_split(source)
    assert train is source and first["x"][0, 0] == 0 and train.get_state() == source.get_state()
    assert [int(batch["x"][0, 0]) for batch in train] == [0, 1, 2]


@pytest.mark.parametrize("given, words", [(7, "gave int for the train split"),
                                          (iter([[1, 2]]), "train batches must be dicts of arrays")])
def test_a_train_split_that_is_neither_arrays_nor_batches_is_a_config_error(given, words):
    with pytest.raises(jm.ConfigError, match=words):
        _train_split(given)
