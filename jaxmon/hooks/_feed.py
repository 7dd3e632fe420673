"""FeedFnHook: extra feeds merged into the batch of every run."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from jaxmon._base.hook import Hook, RunArgs, RunContext


class FeedFnHook(Hook):
    """Merges `feed_fn()` (a dict) into the batch of every run.

    Example:
      >>> import jaxmon as jm
      >>> hook = jm.FeedFnHook(lambda: {"dropout_rate": 0.1})
    """

    def __init__(self, feed_fn: Callable[[], dict[str, Any]]):
        if not callable(feed_fn):
            raise TypeError(f"FeedFnHook feed_fn must be a function returning a dict of feeds; got {feed_fn!r}.")
        self.feed_fn = feed_fn

    def before_run(self, ctx: RunContext) -> RunArgs:
        return RunArgs(feeds=self.feed_fn())

    def __repr__(self) -> str:
        return f"FeedFnHook({getattr(self.feed_fn, '__qualname__', self.feed_fn)!r})"
