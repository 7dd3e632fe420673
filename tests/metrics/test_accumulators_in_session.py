"""Accumulators on the device: NaN checks and window means computed inside the compiled
step, read on the host only at a trigger, a save, sync() or close()."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import dispatch_secs, forever, slow_matmuls, step_times, window_means

import jaxmon as jm
from jaxmon._checkpoints.manager import complete_steps as saved_steps
from jaxmon._run.scan_unroll import dynamic_length


def counting_step(state, batch):
    """State {"n": steps done, "w": a running sum of the losses}; the loss is the step
    number, except NaN at step 37."""
    n = state["n"] + 1
    loss = jnp.where(n == 37, jnp.nan, n.astype(jnp.float32))
    return {"n": n, "w": state["w"] + loss}, {"loss": loss}


def fresh():
    return {"n": jnp.zeros((), jnp.int32), "w": jnp.zeros((), jnp.float32)}


# -- NanHook: the exact first non-finite step ------------------------------------------------


@pytest.mark.parametrize("k", [1, 8])
def test_a_nan_at_step_37_is_reported_as_step_37_and_no_checkpoint_holds_it(k, tmp_path):
    saver = jm.CheckpointSaverHook(tmp_path, save_steps=10)
    with pytest.raises(jm.NanLossDuringTrainingError) as info:
        with jm.MonitoredSession(counting_step, fresh, data=forever(), steps_per_dispatch=k,
                                 hooks=[jm.NanHook("loss"), saver, jm.StopAtStepHook(last_step=100)]) as sess:
            while not sess.should_stop():
                sess.run()
    assert info.value.step == 37 and np.isnan(info.value.value)
    assert "at step 37" in str(info.value)
    # The save of step 40 read the check first: it raised instead of saving.
    assert sess.step == 40
    assert saved_steps(tmp_path) == [0, 10, 20, 30]
    latest = jm.restore_checkpoint(tmp_path)
    assert latest.step == 30 and int(latest.state["n"]) == 30
    assert np.isfinite(latest.state["w"]) and float(latest.state["w"]) == sum(range(1, 31))


@pytest.mark.parametrize("k", [1, 8])
def test_a_clean_nan_stop_saves_nothing_at_or_after_the_bad_step(k, tmp_path):
    saver = jm.CheckpointSaverHook(tmp_path, save_steps=10)
    with jm.MonitoredSession(counting_step, fresh, data=forever(), steps_per_dispatch=k,
                             hooks=[jm.NanHook("loss", fail_on_nan_loss=False), saver,
                                    jm.StopAtStepHook(last_step=100)]) as sess:
        while not sess.should_stop():
            sess.run()
    assert sess.step == 40 and sess.state_rejected and "step 37" in sess.state_rejected
    assert saved_steps(tmp_path) == [0, 10, 20, 30]  # neither step 40 nor the final save at end


class ReadsAt(jm.Hook):
    """Reads its own accumulator (not late) at one step."""

    def __init__(self, step):
        self.step, self.accumulators = step, {"mean": jm.Mean("loss")}

    def before_run(self, ctx):
        return jm.RunArgs(read=True) if ctx.next_step == self.step else None


def test_a_save_at_the_step_another_hook_reads_still_checks_for_nan_first(tmp_path):
    def nan_at_5(state, batch):
        n = state["n"] + 1
        loss = jnp.where(n == 5, jnp.nan, 1.0)
        return {"n": n, "w": state["w"] + loss}, {"loss": loss}

    hooks = [jm.CheckpointSaverHook(tmp_path, save_steps=5), ReadsAt(5), jm.NanHook("loss", every_n_steps=1000)]
    sess = jm.MonitoredSession(nan_at_5, fresh, hooks=hooks)
    with pytest.raises(jm.NanLossDuringTrainingError) as info:
        for _ in range(5):
            sess.run({})
    assert info.value.step == 5 and sess.step == 5
    sess.close()
    assert saved_steps(tmp_path) == [0]


def test_a_caught_nan_error_then_close_saves_nothing_after_the_bad_step(tmp_path):
    hooks = [jm.NanHook("loss", every_n_steps=10), jm.CheckpointSaverHook(tmp_path, save_steps=25)]
    sess = jm.MonitoredSession(counting_step, fresh, data=forever(), hooks=hooks)
    try:
        while True:
            sess.run()
    except jm.NanLossDuringTrainingError as error:
        assert error.step == 37
    finally:
        sess.close()  # a clean close: every end, so the saver's final save, is called
    assert saved_steps(tmp_path) == [0, 25] and sess.state_rejected


def test_nan_hook_reads_every_n_steps_and_raises_at_that_read():
    hook = jm.NanHook("loss", every_n_steps=25)
    sess = jm.MonitoredSession(counting_step, fresh, hooks=[hook])
    steps_run = []
    with pytest.raises(jm.NanLossDuringTrainingError) as info:
        for _ in range(100):
            sess.run({})
            steps_run.append(sess.step)
    # Reads after steps 25 and 50 (delivered a run late): the one of step 50 raises during step 51.
    assert info.value.step == 37 and sess.step == 51 and steps_run[-1] == 50
    sess.close()


def test_every_n_steps_1_acts_by_the_next_run():
    sess = jm.MonitoredSession(counting_step, fresh, hooks=[jm.NanHook("loss", every_n_steps=1)])
    for _ in range(37):
        sess.run({})
    with pytest.raises(jm.NanLossDuringTrainingError) as info:
        sess.run({})
    assert info.value.step == 37 and sess.step == 38
    sess.close()


def test_skip_updates_keeps_the_last_finite_state_up_to_the_limit():
    def step(state, batch):  # the batch says whether this step's loss is infinite
        n = state["n"] + 1
        loss = jnp.where(batch["bad"], jnp.inf, 1.0)
        return {"n": n, "w": state["w"] + loss}, {"loss": loss}

    two_bad = [{"bad": np.bool_(4 <= i <= 5)} for i in range(10)]  # steps 5 and 6
    sess = jm.MonitoredSession(step, fresh, hooks=[jm.NanHook("loss", every_n_steps=1, skip_updates=2)])
    for batch in two_bad:
        sess.run(batch)
    sess.sync()
    # Steps 5 and 6 kept the state of step 4: 8 updates of the 10 steps made it in.
    assert int(sess.state["n"]) == 8 and float(sess.state["w"]) == 8.0 and sess.step == 10
    sess.close()

    three_bad = [{"bad": np.bool_(4 <= i <= 6)} for i in range(10)]  # steps 5, 6 and 7
    sess = jm.MonitoredSession(step, fresh, hooks=[jm.NanHook("loss", every_n_steps=1, skip_updates=2)])
    with pytest.raises(jm.NanLossDuringTrainingError) as info:
        for batch in three_bad:
            sess.run(batch)
    assert info.value.step == 7  # the third in a row is reported
    sess.close()


def test_skip_updates_must_be_a_count():
    with pytest.raises(ValueError, match="skip_updates"):
        jm.NanHook("loss", skip_updates=-1)


# -- window means ------------------------------------------------------------------------------


class WindowMax(jm.Reduction):
    """A user's reduction: the largest value since the last read."""

    def init(self, value):
        return np.full(value.shape, -np.inf, np.float32)

    def update(self, acc, value, step):
        return jnp.maximum(acc, value)

    def result(self, acc, steps):
        return float(acc)


class MaxEvery(jm.Hook):
    def __init__(self, every):
        self.every, self.seen, self.reads = every, [], []
        self.accumulators = {"max": WindowMax("loss"), "mean": jm.Mean("loss")}

    def before_run(self, ctx):
        return jm.RunArgs(read=True) if ctx.next_step % self.every == 0 else None

    def after_run(self, ctx, values):
        if values.accumulated is not None:
            self.seen.append((values.step, values.accumulated["max"], float(values.accumulated["mean"])))

    def after_read(self, step, values):
        self.reads.append(step)


@pytest.mark.parametrize("k", [1, 4])
def test_a_hook_reads_its_own_reduction_over_each_window(k):
    hook = MaxEvery(every=4)
    sess = jm.MonitoredSession(counting_step, fresh, hooks=[hook], steps_per_dispatch=k)
    for _ in range(12 // k):
        sess.run([{}] * k if k > 1 else {})
    assert hook.seen == [(4, 4.0, 2.5), (8, 8.0, 6.5), (12, 12.0, 10.5)]
    compiled = sess.compile_count
    sess.close()
    assert hook.reads == [4, 8, 12]  # close had nothing new to read
    # k=4: on a CPU one program takes runs of 4, 2 and 1 steps; elsewhere the runs of 4 have their own, and the
    # one-step program is compiled ahead beside it
    one_program = k == 1 or dynamic_length("auto", jax.default_backend())
    assert compiled == (1 if one_program else 2) and sess._accumulators.compile_count == 1


class MaxKeeping(MaxEvery):
    """Reads every 2 steps; the reads at steps 2, 6, 10, ... leave its windows open."""

    def before_run(self, ctx):
        if ctx.next_step % 2 == 0:
            return jm.RunArgs(read=True, restart=ctx.next_step % 4 == 0)
        return None


def test_a_read_with_restart_false_leaves_the_hooks_windows_open_and_not_the_others():
    keeping, every_2 = MaxKeeping(every=2), MaxEvery(every=2)
    sess = jm.MonitoredSession(counting_step, fresh, hooks=[keeping, every_2])
    for _ in range(8):
        sess.run({})
    sess.close()
    # The loss of step t is t: windows 1..2, 1..4 (the read at 2 kept it open), 5..6, 5..8.
    assert keeping.seen == [(2, 2.0, 1.5), (4, 4.0, 2.5), (6, 6.0, 5.5), (8, 8.0, 6.5)]
    assert every_2.seen == [(2, 2.0, 1.5), (4, 4.0, 3.5), (6, 6.0, 5.5), (8, 8.0, 7.5)]  # read together, restarted


def test_a_mean_after_a_restore_counts_from_the_restored_step(tmp_path):
    def run_to(last_step, writer):
        hooks = [jm.CheckpointSaverHook(tmp_path, save_steps=8),
                 jm.SummarySaverHook(save_steps=8, summary_writer=writer), jm.StopAtStepHook(last_step=last_step)]
        with jm.MonitoredSession(counting_step, fresh, data=forever(), hooks=hooks) as sess:
            while not sess.should_stop():
                sess.run()

    first, second = jm.JsonlWriter(tmp_path / "a.jsonl"), jm.JsonlWriter(tmp_path / "b.jsonl")
    run_to(8, first)
    run_to(25, second)  # restores step 8: writes at 16 and 24 (counted from step 0), not at its first run
    first.close()
    second.close()
    with open(tmp_path / "b.jsonl") as lines:
        rows = [row for row in map(json.loads, lines) if "loss" in row]
    # the means over steps 9-16 and 17-24: (9 + 16) / 2 = 12.5, (17 + 24) / 2 = 20.5
    assert [(row["step"], row["loss"]) for row in rows] == [(16, 12.5), (24, 20.5)]



class SummariesOfASubclass(jm.SummarySaverHook):
    """A subclass, whose windows restart at each of its reads as the built-in hook's do."""


@pytest.mark.parametrize("resume_k", [1, 4])
@pytest.mark.parametrize("cls", [jm.SummarySaverHook, SummariesOfASubclass])
def test_windows_survive_a_resume_with_other_runs(tmp_path, cls, resume_k):
    def run_to(last_step, name, k):
        writer = jm.JsonlWriter(tmp_path / f"{name}.jsonl")
        hooks = [jm.CheckpointSaverHook(tmp_path / name, save_steps=8), cls(save_steps=4, summary_writer=writer),
                 jm.StopAtStepHook(last_step=last_step)]
        with jm.MonitoredSession(counting_step, fresh, data=forever(), hooks=hooks, steps_per_dispatch=k) as sess:
            while not sess.should_stop():
                sess.run()
            made = sess._accumulators.compile_count
        writer.close()
        return made

    def means(name):
        with open(tmp_path / f"{name}.jsonl") as lines:
            return [(row["step"], row["loss"]) for row in map(json.loads, lines) if "loss" in row]

    made = run_to(8, "resumed", 1), run_to(16, "resumed", resume_k)  # restores step 8, read and saved there
    run_to(16, "whole", 1)
    # The loss at step t is t. Windows 1 (the starting point, which ends no window), 1-4,
    # 5-8 (the first run), then 9-12 and 13-16 whatever the runs after the resume: the
    # means 1, (1 + 4) / 2 = 2.5, (5 + 8) / 2 = 6.5, (9 + 12) / 2 = 10.5, (13 + 16) / 2 = 14.5.
    steps = [1, 4, 8, 12, 16]
    expected = [(1, 1.0), (4, 2.5), (8, 6.5), (12, 10.5), (16, 14.5)]
    assert expected == list(zip(steps, window_means(range(17), steps), strict=True))
    assert means("resumed") == means("whole") == expected
    # The windows restart at the hook's reads (all but the starting point's), with one program for its
    # set of readers, in both sessions.
    assert made == (1, 1)


@pytest.mark.parametrize(("every", "expected"), [(3, [(12, 10.5), (15, 14.0)]), (5, [(15, 12.0)])])
def test_a_resumed_run_whose_period_changed_keeps_each_window_whole(tmp_path, every, expected):
    """Saved at step 10 with summaries every 4 steps (the window open since 8), resumed
    every 3 or 5 steps: the restored timer (last at 8) is woken on the new period's steps,
    and 10 is a step of the period 5 where the window was not read, which the step must
    not restart. No step is lost or counted twice."""
    def run_to(last_step, save_steps, name):
        writer = jm.JsonlWriter(tmp_path / f"{name}.jsonl")
        hooks = [jm.CheckpointSaverHook(tmp_path / "ckpt", save_steps=10),
                 jm.SummarySaverHook(save_steps=save_steps, summary_writer=writer),
                 jm.StopAtStepHook(last_step=last_step)]
        with jm.MonitoredSession(counting_step, fresh, data=forever(), hooks=hooks) as sess:
            while not sess.should_stop():
                sess.run()
        writer.close()
        with open(tmp_path / f"{name}.jsonl") as lines:
            return [(row["step"], row["loss"]) for row in map(json.loads, lines) if "loss" in row]

    # The loss at step t is t: windows 1 (the starting point, which ends no window), 1-4
    # and 5-8, so the means 1, (1 + 4) / 2 = 2.5 and (5 + 8) / 2 = 6.5.
    assert run_to(10, 4, "first") == [(1, 1.0), (4, 2.5), (8, 6.5)]
    assert run_to(15, every, "resumed") == expected  # the first window from step 9
    class Bad(jm.Hook):
        accumulators = {"x": "loss"}

    with pytest.raises(TypeError, match=r"accumulators\['x'\] is 'loss', not a jm.Reduction"):
        jm.MonitoredSession(counting_step, fresh, hooks=[Bad()])


def test_a_reduction_of_a_missing_output_names_the_outputs():
    sess = jm.MonitoredSession(counting_step, fresh, hooks=[jm.NanHook("lost")])
    with pytest.raises(ValueError, match=r"'lost', which is not an output .* \['loss'\]"):
        sess.run({})
    sess.close()


# -- no host read between triggers -----------------------------------------------------------


SIZE, COUNT = slow_matmuls()  # by backend: a step slower than dispatching five runs


def slow_step(state, batch):
    x = jax.lax.fori_loop(0, COUNT, lambda i, x: jnp.tanh(x @ x), state)
    return x, {"loss": x[0, 0] + batch["x"]}


@pytest.mark.parametrize(("k", "scan_unroll"), [(1, "auto"), (8, "auto"), (1, 1), (8, 1)])
def test_the_default_set_with_logging_and_nan_checks_dispatches_runs_without_waiting(k, scan_unroll, tmp_path):
    """For every run length and both program choices: the CPU's one program for every
    length ("auto"), and the accelerators' one program per length (scan_unroll=1)."""
    one = jax.jit(slow_step)
    state = jnp.eye(SIZE, dtype=jnp.float32) * 0.5
    batch = {"x": np.float32(1.0)}
    one_step = step_times(one, state, batch)

    data = iter(lambda: batch, None)
    with jm.MonitoredTrainingSession(slow_step, lambda: jnp.eye(SIZE, dtype=jnp.float32) * 0.5, data=data,
                                     checkpoint_dir=tmp_path, steps_per_dispatch=k, scan_unroll=scan_unroll,
                                     hooks=[jm.LoggingHook(["loss"], every_n_iter=100), jm.NanHook("loss")]) as sess:
        for _ in range(3):  # the first triggers (summaries at step 1, the first log line and read) and compiles
            sess.run()
        compiled = sess.compile_count
        # Five runs from step 3 or 17 (to 8 or 57), five more if the load slowed them: no trigger fires
        dispatch_five = dispatch_secs(sess, below=min(one_step))
        jax.block_until_ready(sess.state)
        assert sess.step < 100
        assert sess.compile_count == compiled
    assert dispatch_five < min(one_step), (dispatch_five, one_step)


# -- batches on the device ahead of their step -------------------------------------------------


class BatchKinds(jm.Hook):
    def __init__(self):
        self.kinds = []

    def before_run(self, ctx):
        self.kinds.append(type(ctx.original_args.feeds["x"]))


def test_host_batches_go_to_the_device_two_runs_ahead():
    taken = []

    def data():
        for i in range(5):
            taken.append(i)
            yield {"x": np.full((3,), i, np.float32)}

    def step(state, batch):
        return state + batch["x"].sum(), {}

    kinds = BatchKinds()
    with jm.MonitoredSession(step, lambda: jnp.zeros(()), data=data(), hooks=[kinds]) as sess:
        sess.run()
        assert taken == [0, 1, 2]  # the run's batch and two more, already copied to the device
        with jax.transfer_guard("disallow"):  # so no dispatch copies a batch
            while not sess.should_stop():
                sess.run()
    assert sess.step == 5 and float(sess.state) == 3 * sum(range(5))
    assert kinds.kinds == [np.ndarray] * 5  # hooks see the batches as the data gave them


def test_an_iterator_with_set_state_gets_back_the_batches_taken_ahead():
    source = jm.ArrayDataSource({"x": np.arange(20, dtype=np.float32)}, batch_size=2, shuffle=False)

    def step(state, batch):
        return state + batch["x"].sum(), {"seen": batch["x"][0]}

    first = jm.MonitoredSession(step, lambda: jnp.zeros(()), data=source)
    for _ in range(3):
        first.run()
    first.close()
    with jm.MonitoredSession(step, lambda: jnp.zeros(()), data=source) as second:
        assert float(second.run(fetches="seen")) == 6.0  # the 4th batch: nothing skipped


def test_an_error_taking_a_batch_ahead_comes_when_that_batch_is_due():
    def data():
        yield {"x": np.float32(1)}
        yield {"x": np.float32(2)}
        raise OSError("the file went away")

    sess = jm.MonitoredSession(lambda s, b: (s + b["x"], {}), lambda: jnp.zeros(()), data=data())
    sess.run()
    sess.run()
    with pytest.raises(OSError, match="went away"):
        sess.run()
    assert sess.step == 2 and float(sess.state) == 3.0
    sess.close()


def test_prefetch_zero_takes_each_batch_when_its_run_starts():
    taken = []

    def data():
        for i in range(3):
            taken.append(i)
            yield {"x": np.float32(i)}

    sess = jm.MonitoredSession(lambda s, b: (s + b["x"], {}), lambda: jnp.zeros(()), data=data(), prefetch=0)
    sess.run()
    assert taken == [0]
    sess.close()
    with pytest.raises(ValueError, match="prefetch"):
        jm.MonitoredSession(lambda s, b: (s, {}), lambda: jnp.zeros(()), prefetch=-1)


# -- hooks that sleep between their triggers -------------------------------------------------


def test_a_subclass_that_replaces_an_event_is_called_every_run(tmp_path):
    class Counting(jm.StepCounterHook):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.steps = []

        def after_run(self, ctx, values):
            self.steps.append(values.step)
            super().after_run(ctx, values)

    hook = Counting(every_n_steps=10, output_dir=tmp_path)
    sess = jm.MonitoredSession(counting_step, fresh, hooks=[hook])
    for _ in range(12):
        sess.run({})
    sess.close()
    assert hook.steps == list(range(1, 13))


def test_the_built_in_periodic_hooks_sleep_between_their_step_triggers(tmp_path):
    hooks = [jm.StepCounterHook(every_n_steps=10, output_dir=tmp_path),
             jm.SummarySaverHook(save_steps=10, output_dir=tmp_path), jm.NanHook("loss", every_n_steps=10)]
    sess = jm.MonitoredSession(counting_step, fresh, hooks=hooks)
    woken = []
    for _ in range(25):
        sess.run({})
        woken.append([trigger.step for trigger in sess._runner._wake])
    sess.close()
    # Each is next needed at the step of its next trigger, 10 then 20 (the step counter's clock starts after
    # the first run; the summaries' step 1 is behind them). After each run the session knows when each sleeps
    # till: no run in between calls one.
    assert woken[0] == [10, 10, 10] and woken[1] == [10, 10, 10]
    assert woken[9] == [20, 20, 20] and woken[10] == [20, 20, 20]


class FakeClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def count_calls(sess):
    """Wraps the hook runner's `before_run`: the list of the steps of the runs that
    called hooks at all."""
    calls, before_run = [], sess._runner.before_run

    def counted(*args, **kwargs):
        plan = before_run(*args, **kwargs)
        if plan.ctx is not None:
            calls.append(plan.ctx.next_step)
        return plan

    sess._runner.before_run = counted
    return calls


def test_runs_that_every_hook_sleeps_through_call_no_hook_and_every_trigger_still_fires(tmp_path):
    logged = []
    hooks = [jm.StopAtStepHook(last_step=237), jm.NanHook("loss", every_n_steps=50),
             jm.LoggingHook(["loss"], every_n_iter=100, reduce="last",
                            formatter=lambda values: logged.append(float(values["loss"])) or "")]
    sess = jm.MonitoredTrainingSession(_finite_step, fresh,
                                       checkpoint_dir=tmp_path, save_checkpoint_steps=100, save_summaries_steps=100,
                                       data=forever(), hooks=hooks)
    calls = count_calls(sess)
    with sess:
        while not sess.should_stop():
            sess.run()
    assert sess.step == 237  # StopAtStepHook slept until its step, and stopped there
    assert logged == [1.0, 100.0, 200.0]  # step 1, then steps 100 and 200
    assert hooks[2].get_state() == {"timer": {"last_step": 200, "waited": None}}
    assert saved_steps(tmp_path) == [0, 100, 200, 237]
    # Only the runs that end on a trigger call hooks: step 1 (summaries, logging, the step counter's clock),
    # the NaN checks at 50 and 150, every hook at 100 and 200, the stop at 237.
    assert calls == [1, 50, 100, 150, 200, 237], calls


def test_periodic_and_eval_hooks_sleep_between_their_triggers_and_fire_on_the_same_steps():
    clock = FakeClock()
    periodic, evaluated = [], []
    hooks = [jm.PeriodicHook(lambda session: periodic.append(session.step), every_n_steps=10),
             jm.PeriodicHook(lambda session: periodic.append(-session.step), every_n_secs=7, clock=clock),
             jm.EvalHook(lambda state, batch: {"n": state["n"]}, data=[{}], every_n_steps=12, at_end=False)]
    sess = jm.MonitoredSession(_finite_step, fresh, data=forever(), hooks=hooks)
    hooks[2].evaluate = lambda session: evaluated.append(session.step)
    calls = count_calls(sess)
    with sess:
        for _ in range(25):
            clock.t += 1.0
            sess.run()
    # After steps 10 and 20, every 7 s from the session's start (a step a second), after steps 12 and 24,
    # as when called on every run; the other runs call no hook (the session's first run asks each hook
    # when it is next due, and none is due there).
    assert [s for s in periodic if s > 0] == [10, 20] and [-s for s in periodic if s < 0] == [7, 14, 21]
    assert evaluated == [12, 24]
    assert calls == [1, 7, 10, 12, 14, 20, 21, 24], calls


def _finite_step(state, batch):
    n = state["n"] + 1
    loss = n.astype(jnp.float32)
    return {"n": n, "w": state["w"] + loss}, {"loss": loss}


def test_a_seconds_timer_sleeps_until_its_time_and_fires_on_the_first_run_after_it(tmp_path):
    clock = FakeClock()
    saver = jm.CheckpointSaverHook(tmp_path, save_secs=10, clock=clock)
    logged = []
    logging = jm.LoggingHook(["loss"], every_n_secs=25, reduce="last", clock=clock,
                             formatter=lambda values: logged.append(float(values["loss"])) or "")
    sess = jm.MonitoredSession(_finite_step, fresh, data=forever(), hooks=[saver, logging])
    calls = count_calls(sess)
    with sess:
        for _ in range(35):
            clock.t += 1.0
            sess.run()
    assert saver.saved_steps == [0, 10, 20, 30, 35]
    # step 1, then the first run that ends 25 s after that line (each line starts the next interval)
    assert logged == [1.0, 26.0]
    assert calls == [1, 10, 20, 26, 30], calls  # the runs on which a timer is due, and no other


def test_a_preemption_wakes_a_sleeping_saver_at_the_next_run(tmp_path):
    saver = jm.CheckpointSaverHook(tmp_path, save_secs=600)
    sess = jm.MonitoredSession(_finite_step, fresh, data=forever(), hooks=[saver])
    for _ in range(12):
        sess.run()
    sess.request_preemption()
    sess.run()
    assert sess.should_stop() and saver.saved_steps == [0, 13]
    sess.close()
    assert saved_steps(tmp_path) == [0, 13]


def test_a_logging_hook_keeps_its_schedule_across_a_resume(tmp_path):
    def run(steps):
        logged = []
        hook = jm.LoggingHook(["loss"], every_n_iter=10, reduce="last",
                              formatter=lambda values: logged.append(float(values["loss"])) or "")
        saver = jm.CheckpointSaverHook(tmp_path, save_steps=15)
        hooks = [saver, hook, jm.StopAtStepHook(last_step=steps)]
        with jm.MonitoredSession(_finite_step, fresh, data=forever(), hooks=hooks) as sess:
            while not sess.should_stop():
                sess.run()
        return logged, hook.get_state()["timer"]["last_step"]

    assert run(33) == ([1.0, 10.0, 20.0, 30.0], 30)
    # Resumed from step 33 (saved at the end): no line at its first step, the next lines are steps 40 and 50.
    assert run(55) == ([40.0, 50.0], 50)
