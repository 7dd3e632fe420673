"""ArrayDataSource: batches of in-memory arrays, their per-process shards of one global
batch, and positions that resume on another count of shards."""

import numpy as np
import pytest

import jaxmon as jm


def test_array_data_source_shards_split_every_global_batch_into_equal_parts():
    rows = {"x": np.arange(10)}
    shards = [jm.ArrayDataSource(rows, 1, shard=(i, 3), num_epochs=1, shuffle=False) for i in range(3)]
    seen = [[int(batch["x"][0]) for batch in shard] for shard in shards]
    assert seen == [[0, 3, 6], [1, 4, 7], [2, 5, 8]]  # global batches of 3 rows; row 9 left out
    assert [shard.get_state() for shard in shards] == [{"epoch": 0, "index": 3, "seed": 0, "global_batch": 3}] * 3
    process = jm.ArrayDataSource(rows, 2, shard="process")  # one process here: every row
    assert process.shard == (0, 1) and process.num_rows == 10 and process.global_batch == 2


def test_array_data_source_shards_resume_on_another_count_with_the_same_global_batches():
    rows = {"x": np.arange(24)}
    expected = [batch["x"] for batch, _ in zip(jm.ArrayDataSource(rows, 4, seed=3), range(8), strict=False)]
    two = [jm.ArrayDataSource(rows, 2, shard=(i, 2), seed=3) for i in range(2)]
    first = [np.concatenate([next(shard)["x"] for shard in two]) for _ in range(3)]
    np.testing.assert_array_equal(first, expected[:3])
    state = two[0].get_state()
    assert state == two[1].get_state() == {"epoch": 0, "index": 3, "seed": 3, "global_batch": 4}
    one, four = jm.ArrayDataSource(rows, 4, shard=(0, 1), seed=3), [
        jm.ArrayDataSource(rows, 1, shard=(i, 4), seed=3) for i in range(4)]
    for source in (one, *four):
        source.set_state(state)
    np.testing.assert_array_equal([next(one)["x"] for _ in range(5)], expected[3:])  # into the next epoch
    np.testing.assert_array_equal([np.concatenate([next(shard)["x"] for shard in four]) for _ in range(5)],
                                  expected[3:])


def test_array_data_source_refuses_a_position_of_other_global_batches_and_a_bad_shard():
    state = jm.ArrayDataSource({"x": np.arange(10)}, 2, shard=(0, 2)).get_state()
    with pytest.raises(ValueError, match=r"batches of 4 rows .*\(2 rows x 1 shards\); for the same batches give "
                                         r"batch_size=4\."):
        jm.ArrayDataSource({"x": np.arange(10)}, 2, shard=(0, 1)).set_state(state)
    with pytest.raises(ValueError, match=r"shard=\(2, 2\).*'process'"):
        jm.ArrayDataSource({"x": np.arange(10)}, 1, shard=(2, 2))


def test_batches_are_the_same_rows_of_every_array_and_an_epoch_is_a_permutation_of_the_rows():
    arrays = {"x": np.arange(12), "y": np.arange(12) * 10}
    source = jm.ArrayDataSource(arrays, 4, seed=1)
    assert len(source) == 3
    epoch = [next(source) for _ in range(3)]
    assert all(np.array_equal(batch["y"], batch["x"] * 10) for batch in epoch)
    assert sorted(np.concatenate([batch["x"] for batch in epoch]).tolist()) == list(range(12))
    following = np.concatenate([next(source)["x"] for _ in range(3)])
    assert not np.array_equal(following, np.concatenate([batch["x"] for batch in epoch]))  # reshuffled
    assert source.get_state() == {"epoch": 1, "index": 3, "seed": 1}
    again = jm.ArrayDataSource(arrays, 4, seed=1)
    assert np.array_equal(np.concatenate([next(again)["x"] for _ in range(3)]),
                          np.concatenate([batch["x"] for batch in epoch]))  # one seed: one order


def test_a_position_resumes_the_batches_exactly_and_another_seed_is_refused():
    arrays = np.arange(20)  # a single array: given as {"x": array}
    source = jm.ArrayDataSource(arrays, 3, seed=5)
    for _ in range(8):  # into the second epoch
        next(source)
    resumed = jm.ArrayDataSource(arrays, 3, seed=5)
    resumed.set_state(source.get_state())
    np.testing.assert_array_equal([next(resumed)["x"] for _ in range(6)], [next(source)["x"] for _ in range(6)])
    with pytest.raises(ValueError, match="taken with seed 5, this source has seed 6; resume with the same seed"):
        jm.ArrayDataSource(arrays, 3, seed=6).set_state(source.get_state())


def test_the_last_smaller_batch_is_kept_on_request_and_num_epochs_ends_the_data():
    source = jm.ArrayDataSource({"x": np.arange(5)}, 2, shuffle=False, drop_remainder=False, num_epochs=2)
    assert len(source) == 3
    assert [batch["x"].tolist() for batch in source] == [[0, 1], [2, 3], [4], [0, 1], [2, 3], [4]]
    dropped = jm.ArrayDataSource({"x": np.arange(5)}, 2, shuffle=False, num_epochs=1)
    assert [batch["x"].tolist() for batch in dropped] == [[0, 1], [2, 3]]


@pytest.mark.parametrize("kwargs, words", [
    ({"arrays": {}}, "non-empty dict of arrays with one first dimension; got lengths {}"),
    ({"arrays": {"x": np.zeros(3), "y": np.zeros(4)}}, "got lengths {'x': 3, 'y': 4}"),
    ({"batch_size": 0}, "batch_size must be an int >= 1; got 0"),
    ({"batch_size": 11}, "batch_size=11 takes 11 rows a step (all shards together), more than the 10 rows"),
    ({"seed": -1}, "seed must be an int >= 0; got -1"),
    ({"num_epochs": 0}, "num_epochs must be an int >= 1; got 0"),
    ({"shard": (1, 1)}, "shard=(1, 1): give 'process'"),
    ({"shard": "host"}, "shard='host': give 'process'"),
], ids=["empty", "lengths", "batch-0", "batch-too-big", "seed", "epochs", "shard-index", "shard-word"])
def test_bad_arguments_are_refused_naming_them(kwargs, words):
    arguments = {"arrays": {"x": np.zeros(10)}, "batch_size": 2, **kwargs}
    with pytest.raises(ValueError) as error:
        jm.ArrayDataSource(arguments.pop("arrays"), arguments.pop("batch_size"), **arguments)
    assert words in str(error.value)


def test_repr_names_the_arrays_rows_and_options():
    source = jm.ArrayDataSource({"y": np.zeros(6), "x": np.zeros(6)}, 3, shuffle=False, shard=(0, 2))
    assert repr(source) == "ArrayDataSource(['x', 'y'], rows=6, batch_size=3, shuffle=False, seed=0, shard=(0, 2))"
