"""Where a session's batches come from, on its own: `BatchSource` over a plain iterator
and over one with a position (a small fake), the positions of batches taken ahead,
runs placed on the device ahead (of one step and of several), `give_back`, `restore`,
multi-step runs in powers of two, `fill`; and `as_run`/`Steps`. No session and no
step: batches are tiny NumPy dicts."""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import Counter, Plain

from jaxmon._run.batches import BatchSource, Placed, Steps, as_run, place_on_device


class Loader:
    """An iterable that makes a `Counter` (the session then owns the iterator)."""

    def __init__(self, count=100):
        self.made = []
        self.count = count

    def __iter__(self):
        self.made.append(Counter(self.count))
        return self.made[-1]


def no_limit(step, limit):
    return limit


def xs(batch):
    """The "x" values of a run's batch (one batch, a `Steps`, or a `Placed` run's as given)."""
    batch = batch.given if isinstance(batch, Placed) else batch
    items = batch.items if isinstance(batch, Steps) else batch if isinstance(batch, list) else [batch]
    return [float(item["x"]) for item in items]


def test_without_prefetch_each_run_takes_its_batch_when_it_starts():
    data = Counter()
    source = BatchSource(data, 1, no_limit, prefetch=0)
    assert source.has_data and not BatchSource(None, 1, no_limit).has_data
    assert xs(source.next(0)) == [1.0] and data.i == 1
    assert source.position() == {"i": 1}  # nothing ahead: the iterator's own position
    assert isinstance(source.next(1)["x"], np.floating)  # left on the host


def test_batches_taken_ahead_keep_the_position_before_each():
    data = Counter()
    source = BatchSource(data, 1, no_limit, prefetch=2)
    first = source.next(0)
    assert xs(first) == [1.0] and data.i == 3  # the run's batch and two more
    assert source.position() == {"i": 1}  # before the first batch not run: batch 2
    second = source.next(1)
    assert isinstance(second.batch["x"], jax.Array)  # sent to the device while waiting
    assert isinstance(second.given["x"], np.floating)  # hooks see it as the data gave it
    assert xs(second) == [2.0] and source.position() == {"i": 2} and data.i == 4


def test_a_plain_iterator_has_no_position_and_is_taken_ahead_alike():
    data = Plain()
    source = BatchSource(data, 1, no_limit, prefetch=2)
    assert [xs(source.next(step)) for step in range(3)] == [[1.0], [2.0], [3.0]]
    assert data.i == 5 and source.position() is None


def test_give_back_sets_a_given_iterator_back_to_the_first_batch_not_run():
    data = Counter()
    source = BatchSource(data, 1, no_limit, prefetch=3)
    source.next(0)
    source.next(1)
    assert data.i == 5
    source.give_back()
    assert data.i == 2 and not data.closed  # the caller's: carries on from batch 3
    assert next(data) == {"x": 3.0}


def test_give_back_of_a_plain_iterator_leaves_it_where_it_is():
    data = Plain()
    source = BatchSource(data, 1, no_limit, prefetch=2)
    source.next(0)
    source.give_back()  # no set_state: the batches taken ahead are lost
    assert data.i == 3


def test_give_back_closes_an_iterator_the_source_made():
    loader = Loader()
    source = BatchSource(loader, 1, no_limit, prefetch=2)
    source.next(0)
    [made] = loader.made
    source.give_back()
    assert made.closed and made.i == 3  # closed, not set back


def test_restore_sets_the_position_and_drops_the_batches_taken_ahead():
    data = Counter()
    source = BatchSource(data, 1, no_limit, prefetch=2)
    source.next(0)
    assert source.restore({"i": 10}, 10, recovering=True) is True
    assert data.i == 10
    assert xs(source.next(10)) == [11.0]  # not a batch taken before the restore


def test_restore_without_set_state_warns_and_says_it_did_not(caplog):
    source = BatchSource(Plain(), 1, no_limit)
    with caplog.at_level(logging.WARNING, logger="jaxmon"):
        assert source.restore({"i": 10}, 7, recovering=False) is False
    assert "Checkpoint 7 holds a data position, but this session's data has no set_state()" in caplog.text


def test_restore_of_a_checkpoint_without_a_position_warns_only_at_creation(caplog):
    source = BatchSource(Counter(), 1, no_limit)
    with caplog.at_level(logging.WARNING, logger="jaxmon"):
        assert source.restore(None, 4, recovering=True) is False
        assert caplog.text == ""
        assert source.restore(None, 4, recovering=False) is False
    assert "Checkpoint 4 holds no data position; the data restarts from its beginning" in caplog.text
    assert BatchSource(Plain(), 1, no_limit).restore(None, 4, recovering=False) is False


@pytest.mark.parametrize("make", [Counter, Plain])
def test_multi_step_runs_are_cut_by_the_run_limit_to_a_power_of_two(make):
    asked = []

    def run_limit(step, limit):
        asked.append((step, limit))
        return min(limit, 13 - step)  # a hook must act at step 13

    source = BatchSource(make(), 8, run_limit)
    lengths, step = [], 0
    for _ in range(6):
        batch = source.next(step)
        lengths.append(len(xs(batch)))
        step += lengths[-1]
    assert lengths == [8, 4, 1, 1, 1, 1]  # 8 + 4 + 1 = 13, then runs of 1 (the limit is 1 from there)
    assert asked[:3] == [(0, 8), (8, 8), (12, 8)]
    assert xs(source.next(step)) == [float(step + 1)]  # no batch skipped or repeated


def test_a_multi_step_run_stacks_its_batches_and_keeps_the_positions_of_those_taken_ahead():
    data = Counter()
    source = BatchSource(data, 4, lambda step, limit: 3)  # 3 allowed: runs of 2
    batch = source.next(0)
    assert isinstance(batch, Steps) and xs(batch) == [1.0, 2.0]
    assert data.i == 2 and source.position() == {"i": 2}
    steps, stacked, items = as_run(batch, 4)
    assert steps == 2 and stacked["x"].tolist() == [1.0, 2.0] and items is batch.items
    assert source.fill(3) == 3 and data.i == 5  # taken ahead (as for an agreement of processes)
    assert xs(source.next(2)) == [3.0, 4.0] and source.position() == {"i": 4}
    source.give_back()
    assert data.i == 4


def test_the_end_of_data_runs_what_is_left_in_powers_of_two_then_stops():
    for make in (Counter, Plain):
        source = BatchSource(make(7), 8, no_limit)
        lengths = []
        with pytest.raises(StopIteration):
            for step in range(10):
                lengths.append(len(xs(source.next(step))))
        assert lengths == [4, 2, 1]


def test_an_empty_source_stops_at_once():
    with pytest.raises(StopIteration):
        BatchSource(Counter(0), 1, no_limit, prefetch=0).next(0)
    with pytest.raises(StopIteration):
        BatchSource(Counter(0), 1, no_limit, prefetch=2).next(0)
    with pytest.raises(StopIteration):
        BatchSource(Counter(0), 4, no_limit).next(0)


def test_fill_takes_ahead_up_to_a_count_and_the_end_comes_when_due():
    data = Counter(5)
    source = BatchSource(data, 1, no_limit, prefetch=0)
    assert source.fill(3) == 3 and data.i == 3
    assert source.position() == {"i": 0}  # none run yet
    assert source.fill(2) == 3  # already enough waiting
    assert source.fill(10) == 5  # the data ended: what waits
    assert [float(source.next(step)["x"]) for step in range(5)] == [1.0, 2.0, 3.0, 4.0, 5.0]
    with pytest.raises(StopIteration):
        source.next(5)


def test_fill_raises_an_error_of_the_data_now():
    def broken():
        yield {"x": np.float32(1)}
        raise OSError("the file went away")

    source = BatchSource(broken(), 1, no_limit, prefetch=0)
    with pytest.raises(OSError, match="went away"):
        source.fill(3)


class Placing:
    """`place_on_device`, counting the runs it places (their first "x")."""

    def __init__(self):
        self.placed = []

    def __call__(self, batches):
        self.placed.append(float(batches[0]["x"]))
        return place_on_device(batches)


def test_multi_step_runs_go_to_the_device_stacked_a_run_ahead_of_their_dispatch():
    data, place = Counter(), Placing()
    source = BatchSource(data, 4, no_limit, prefetch=1, place=place)
    first = source.next(0)
    assert isinstance(first, Placed) and first.steps == 4 and xs(first) == [1.0, 2.0, 3.0, 4.0]
    assert isinstance(first.batch["x"], jax.Array) and first.batch["x"].tolist() == [1.0, 2.0, 3.0, 4.0]
    assert data.i == 8 and place.placed == [1.0, 5.0]  # this run, and the next one ahead
    assert source.position() == {"i": 4}  # the batches placed ahead are not run yet
    second = source.next(4)
    assert second.batch["x"].tolist() == [5.0, 6.0, 7.0, 8.0] and place.placed == [1.0, 5.0, 9.0]  # as placed


def test_a_run_the_hooks_end_elsewhere_is_placed_again_when_due_with_no_batch_lost():
    limit, place = {"until": 100}, Placing()
    source = BatchSource(Counter(), 4, lambda step, most: min(most, limit["until"] - step), prefetch=1, place=place)
    assert xs(source.next(0)) == [1.0, 2.0, 3.0, 4.0]  # run 5-8 placed ahead
    limit["until"] = 6  # a hook now acts at step 6: the run placed ahead is two steps too long
    run = source.next(4)
    assert xs(run) == [5.0, 6.0] and run.batch["x"].tolist() == [5.0, 6.0]
    assert place.placed == [1.0, 5.0, 5.0, 7.0]  # placed again, then the next ahead
    limit["until"] = 100
    assert xs(source.next(6)) == [7.0, 8.0, 9.0, 10.0]


def test_as_run_of_one_batch_gives_it_twice_and_of_a_list_stacks_it():
    batch = {"x": np.float32(1)}
    assert as_run(batch, 1) == (1, batch, batch)
    listed = [{"x": np.ones(2)}, {"x": np.zeros(2)}]
    steps, stacked, items = as_run(listed, 4)
    assert steps == 2 and stacked["x"].shape == (2, 2) and items is listed
    assert as_run(listed, 1) == (1, listed, listed)  # one step per run: a list is one batch


def test_steps_of_device_batches_stay_a_list_and_bad_lists_are_refused():
    on_device = [{"x": jnp.ones(2)}, {"x": jnp.zeros(2)}]
    assert Steps(on_device).stacked() is on_device  # the compiled step stacks them
    with pytest.raises(ValueError, match="empty list of batches"):
        Steps([])
    with pytest.raises(ValueError, match="The 2 batches of one run must have the same structure and shapes"):
        Steps([{"x": np.ones(2)}, {"x": np.ones(3)}]).stacked()


def test_a_batch_already_on_the_device_mid_stream_loses_none_of_the_batches_taken_ahead():
    """A batch already on the device stops the prefetch (nothing to gain); the host
    batches taken ahead before it must still be run, in order."""
    data = iter([{"x": np.float32(1)}, {"x": np.float32(2)}, {"x": jnp.float32(3)}, {"x": np.float32(4)},
                 {"x": np.float32(5)}])
    source = BatchSource(data, 1, no_limit, prefetch=2)
    assert [xs(source.next(step)) for step in range(5)] == [[1.0], [2.0], [3.0], [4.0], [5.0]]
