"""Agreement points, decided from what every process reports: one JAX process here,
with the all-gather replaced by the rows a peer would send (the real two-process runs
are in tests/end_to_end/test_multiprocess.py)."""

from __future__ import annotations

import math

import numpy as np
import pytest

import jaxmon as jm
from jaxmon._processes import agree as _agree
from jaxmon._run.stopping import Preemption, Stopping

INF = math.inf


def peer(stop=0.0, failed=0.0, error_step=-1.0, event=INF, deadline=INF, batches=INF, rollback=0.0, host=0.001):
    """A peer's row: [stop, failed, chief's clock (read from process 0's), error step, plan,
    a roll-back, its host seconds per step]."""
    return [stop, failed, 0.0, error_step, event, deadline, batches, rollback, host]


@pytest.fixture
def peers(monkeypatch):
    """Sets what the other process sends: `peers.row` (one agreement's vector) and
    `peers.message` (its error text); records every step this process agreed at."""

    class Peers:
        row, message, steps = peer(), "", []

    def gather(values, step):
        if values.shape == (9,):
            Peers.steps.append(step)
            return np.stack([values, np.asarray(Peers.row, np.float64)])
        text = Peers.message.encode().ljust(values.size, b"\0")[:values.size]
        return np.stack([values, np.frombuffer(text, np.uint8)])

    monkeypatch.setattr(_agree, "_gather", gather)
    Peers.steps = []
    return Peers


def decide(peers, step, *, every=8, event=INF, deadline=INF, batches=INF, clock=100.0, theirs=None):
    """The decision at `step`, given this process's plan and the peer's row `theirs`."""
    peers.row = theirs or peer()
    agreement = _agree.Agreement(clock=lambda: clock)
    return agreement(step, stop=False, error=None, plan=_agree.Plan(event, deadline, batches), every=every)


def test_the_next_point_is_the_next_multiple_of_every_n_steps_when_nothing_comes_before(peers):
    assert decide(peers, 3).next == 8
    assert decide(peers, 8).next == 16
    assert decide(peers, 0, every=1).next == 1


def test_a_trigger_of_any_process_makes_its_step_and_the_one_before_agreement_points(peers):
    assert decide(peers, 8, event=13).next == 12  # this process's hook acts at 13
    assert decide(peers, 8, theirs=peer(event=13)).next == 12  # the peer's
    assert decide(peers, 12, event=13).next == 13
    assert decide(peers, 13, event=5).next == 14  # a hook due now acts on the next run


def test_a_seconds_trigger_due_on_the_chiefs_clock_makes_the_next_run_one(peers):
    assert decide(peers, 3, clock=100.0, deadline=99.0).next == 4
    assert decide(peers, 3, clock=100.0, theirs=peer(deadline=100.0)).next == 4  # a peer's hook
    assert decide(peers, 3, clock=100.0, deadline=101.0).next == 8


def test_the_batches_a_process_has_ahead_bound_the_next_point_and_none_left_stops_all(peers):
    decision = decide(peers, 16, batches=8, theirs=peer(batches=5))
    assert decision.next == 21 and not decision.stop
    decision = decide(peers, 21, batches=8, theirs=peer(batches=0))
    assert decision.stop and decision.stopped_by == (1,)


def test_a_failing_peer_gives_its_process_message_and_its_own_step(peers):
    peers.message = "NanLossDuringTrainingError: NaN loss during training: 'loss' = nan at step 37."
    decision = decide(peers, 101, theirs=peer(failed=1.0, error_step=37.0))
    assert decision.stop and decision.failure == (1, peers.message, 37) and decision.rollback is None


def test_a_peer_that_rolls_back_makes_every_process_roll_back_past_its_bad_step(peers):
    peers.message = "RollbackError: NaN loss during training: 'loss' = nan at step 37; rolling back."
    decision = decide(peers, 40, theirs=peer(failed=1.0, error_step=37.0, rollback=1.0))
    assert decision.rollback == 37 and decision.failure == (1, peers.message, 37)


class FakeBatches:
    has_data = False


class FakeRunner:  # hooks that never act
    hooks = ()

    def next_event(self):
        return INF, INF

    def deliver_late(self):
        pass


class FakeSession:
    """The session's step: `step[0]`."""

    def __init__(self, step):
        self._step = step

    @property
    def step(self):
        return self._step[0]


def runs(peers):
    """An `AgreedRuns` agreeing every 8 steps, and its `Stopping`; `step[0]` is its step."""
    step = [0]
    stopping = Stopping(Preemption(handle_sigterm=False, several_processes=False), agreed=True)
    agreed = _agree.AgreedRuns(FakeBatches(), FakeRunner(), stopping, FakeSession(step), every_n_steps=8)
    return agreed, step


def test_runs_agree_before_the_first_and_then_only_at_agreement_points(peers):
    agreed, step = runs(peers)

    run_once = failing_at(step, None)
    for _ in range(17):
        agreed.run(run_once, {})
    assert peers.steps == [0, 8, 16]  # before the first run, then every 8 steps (no hook acts)
    assert agreed.next == 24


def failing_at(step, failing):
    """A run that advances the step by one and raises after step `failing`."""
    def run_once(batch):
        step[0] += 1
        if step[0] == failing:
            raise ValueError(f"a check of step {failing} failed")

    return run_once


def test_an_error_between_agreement_points_is_raised_at_the_next_one(peers):
    agreed, step = runs(peers)
    run_once = failing_at(step, 3)
    for _ in range(7):  # steps 1 to 7: the error of step 3 waits for the agreement after step 8
        agreed.run(run_once, {})
    with pytest.raises(ValueError, match="step 3"):
        agreed.run(run_once, {})
    assert peers.steps == [0, 8] and agreed._stopping.decided


def test_an_error_held_at_close_is_raised_there_and_the_peer_gets_a_peer_error(peers):
    agreed, step = runs(peers)
    run_once = failing_at(step, 3)
    for _ in range(5):
        agreed.run(run_once, {})
    with pytest.raises(ValueError, match="step 3"):
        agreed.close()
    assert peers.steps == [0, 5]
    # The peer's side: this process reports a failure at close; the peer raises PeerError.
    agreed, step = runs(peers)
    run_once = failing_at(step, None)
    for _ in range(5):
        agreed.run(run_once, {})
    peers.row, peers.message = peer(failed=1.0, error_step=5.0), "ValueError: a check of step 3 failed"
    with pytest.raises(jm.PeerError, match="JAX process 1 failed after step 5: ValueError: a check") as raised:
        agreed.close()
    assert raised.value.step == 5
    agreed.close()  # the last run was agreed now: nothing more


def test_agree_every_n_steps_must_be_a_positive_int():
    with pytest.raises(ValueError, match="agree_every_n_steps must be an int >= 1; got 0"):
        jm.MonitoredSession(lambda s, b: (s, {}), lambda: np.zeros(()), agree_every_n_steps=0)


def test_a_peer_s_roll_back_restores_this_process_too_and_both_go_on(peers):
    """This process saw nothing wrong; the other rolls back past its step 5 at the agreement
    after step 8: this one gets the agreed roll-back, re-creates its state (back to step 0
    here) and stops asking for a stop it had asked at an undone step."""
    step, recreated = [0], []
    stopping = Stopping(Preemption(handle_sigterm=False, several_processes=False), agreed=True)

    def recreate(error):
        recreated.append((type(error).__name__, error.step, getattr(error, "agreed", False)))
        step[0] = 0
        peers.row = peer()  # the other process is back in step too

    agreed = _agree.AgreedRuns(FakeBatches(), FakeRunner(), stopping, FakeSession(step), every_n_steps=8,
                               recreate=recreate)
    run_once = failing_at(step, None)
    for _ in range(7):
        agreed.run(run_once, {})
    stopping.request()  # asked at step 7, a step the roll-back undoes
    peers.message = "RollbackError: NaN loss during training: 'loss' = nan at step 5; rolling back."
    peers.row = peer(failed=1.0, error_step=5.0, rollback=1.0)
    agreed.run(run_once, {})  # step 8: the agreement rolls back; after the re-creation, one more run
    assert recreated == [("RollbackError", 5, True)]
    assert step[0] == 1 and not stopping.decided and not stopping.requested
    assert peers.steps[-2:] == [8, 0]  # the roll-back's agreement, then the one before the first run again


def test_a_roll_back_not_every_failing_process_agrees_on_is_raised_not_carried_out(peers):
    step = [0]
    stopping = Stopping(Preemption(handle_sigterm=False, several_processes=False), agreed=True)
    agreed = _agree.AgreedRuns(FakeBatches(), FakeRunner(), stopping, FakeSession(step), every_n_steps=8,
                               recreate=lambda error: pytest.fail("re-created without an agreement"))

    def bad_at_8(batch):
        step[0] += 1
        if step[0] == 8:
            raise jm.NanLossDuringTrainingError("NaN at step 8", step=8)

    for _ in range(7):
        agreed.run(bad_at_8, {})
    peers.message = "RollbackError: a roll-back"
    peers.row = peer(failed=1.0, error_step=5.0, rollback=1.0)  # the peer would roll back; this one raises
    with pytest.raises(jm.NanLossDuringTrainingError, match="NaN at step 8"):
        agreed.run(bad_at_8, {})
