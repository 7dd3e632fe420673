"""Where a session's time goes (`_ops/time_spent.py`): the start-up breakdown."""

import pytest

from jaxmon._ops import time_spent


def test_start_up_counts_every_second_once_the_rest_what_no_part_names():
    created = {"compile": 0.0, "init": 0.6, "restore": 0.4, "checkpoint": 0.5, "data": 0.0, "evaluation": 0.0,
               "hooks": 0.1}
    secs = {"compile": 2.0, "init": 0.6, "restore": 0.4, "checkpoint": 0.5, "data": 0.1, "evaluation": 0.4,
            "hooks": 0.2}
    parts = time_spent.start_up({"imports and config": 1.5, "data and model": 0.3}, created, session_secs=1.75,
                                secs=secs, total=6.4)
    assert parts == pytest.approx({"imports and config": 1.5, "data and model": 0.3, "state": 1.0,
                                   "checkpoint 0": 0.5, "session set-up": 0.25, "compile": 2.0,
                                   "first evaluation": 0.4, "first batch and hooks": 0.2, "the rest": 0.25})
    assert abs(sum(parts.values()) - 6.4) < 1e-9


def test_this_process_knows_how_long_it_has_run():
    seconds = time_spent.process_seconds()
    assert seconds is not None and 0 < seconds < 24 * 3600  # Linux: from /proc
