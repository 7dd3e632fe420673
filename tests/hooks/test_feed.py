"""FeedFnHook: the batch it feeds every run, merged with the caller's."""

import numpy as np
import pytest
from helpers import zero

import jaxmon as jm


def x_plus_one(state, batch):
    return state, {"y": batch["x"] + 1}


def test_feed_fn_feeds_every_run_once():
    calls = []

    def feed_fn():
        calls.append(1)
        return {"x": 1.0}

    sess = jm.MonitoredSession(x_plus_one, zero, hooks=[jm.FeedFnHook(feed_fn)])
    y = sess.run(fetches="y")  # a single name gives its value itself
    assert isinstance(y, np.ndarray) and float(y) == 2.0
    assert len(calls) == 1
    outputs = sess.run()
    assert float(outputs["y"]) == 2.0 and len(calls) == 2
    for _ in range(3):
        sess.run()
    assert len(calls) == 5


def test_feed_fn_merges_with_the_callers_batch():
    def add(state, batch):
        return state, {"sum": batch["x"] + batch["z"]}

    sess = jm.MonitoredSession(add, zero, hooks=[jm.FeedFnHook(lambda: {"x": 1.0})])
    total = sess.run({"z": 10.0}, fetches="sum")
    assert isinstance(total, np.ndarray) and float(total) == 11.0


def test_feed_fn_must_be_callable():
    with pytest.raises(TypeError, match="feed_fn"):
        jm.FeedFnHook({"x": 1.0})


def test_a_key_fed_by_the_caller_and_the_feed_fn_is_an_error():
    sess = jm.MonitoredSession(x_plus_one, zero, hooks=[jm.FeedFnHook(lambda: {"x": 1.0})])
    with pytest.raises(RuntimeError, match="'x'"):
        sess.run({"x": 5.0})
    assert sess.step == 0
