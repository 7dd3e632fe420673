"""Goodput: a run whose data waits a known time per batch, whose evaluation sleeps a
known time, and which is killed and resumed (redoing known steps), reports each of those
categories within 10 % of the known figure, over both processes of the run; `jaxmon
inspect` prints the breakdown."""

import json
import os
import subprocess
import sys
import textwrap
import time

import pytest
import warm_processes
from helpers import ROOT

import jaxmon as jm

pytestmark = pytest.mark.processes

DATA_SECS, EVAL_SECS = 0.1, 0.3  # per batch of data; per evaluation batch (two per evaluation)
WATCHDOG_SECS = 3.0  # a hung step: the watchdog ends the process after this long

SCRIPT = textwrap.dedent(f"""
    import os, sys, time
    import jax.numpy as jnp, numpy as np
    import jaxmon as jm

    workdir, crash_at, hang = sys.argv[1], int(sys.argv[2]), sys.argv[3:] == ["hang"]

    class Slow:  # the data: {DATA_SECS} s per batch (more under load: each printed), with a position
        def __init__(self):
            self.source = jm.ArrayDataSource({{"x": np.ones((1000, 2), np.float32)}}, batch_size=2, shuffle=False)
        def __iter__(self):
            return self
        def __next__(self):
            start, position = time.monotonic(), self.source.get_state()["index"]
            time.sleep({DATA_SECS})
            batch = next(self.source)
            print("BATCH", position, time.monotonic() - start, flush=True)
            return batch
        def get_state(self):
            return self.source.get_state()
        def set_state(self, state):
            self.source.set_state(state)

    class SleepyEval:  # two batches of {EVAL_SECS} s each (more under load: each printed, and the whole)
        def __iter__(self):
            print("EVALUATION", flush=True)
            began = time.monotonic()
            for _ in range(2):
                start = time.monotonic()
                time.sleep({EVAL_SECS})
                print("EVALUATION BATCH", time.monotonic() - start, flush=True)
                yield {{"x": np.ones((2, 2), np.float32)}}
            print("EVALUATION SECS", time.monotonic() - began, flush=True)  # its batches and their steps

    def step_fn(state, batch):
        state = state + batch["x"].sum()
        return state, {{"loss": state}}

    def eval_fn(state, batch):
        return {{"loss": state + batch["x"].sum()}}

    class Crash(jm.Hook):
        def after_run(self, run_context, run_values):
            if run_values.step == crash_at:  # after the breakdown of this step was recorded
                print("CRASH", time.time(), flush=True)
                time.sleep(0.5)  # the record is written off the loop: let it land (a crash between two records
                if hang:         # leaves the steps after the last one to the idle time between the processes)
                    time.sleep(600)  # until the watchdog ends the process
                os._exit(3)

    hooks = [jm.EvalHook(eval_fn, SleepyEval(), every_n_steps=20), jm.StopAtStepHook(last_step=60),
             jm.GoodputHook(output_dir=workdir, every_n_steps=5, record_every_secs=0),  # replaces the standard one
             Crash()]
    with jm.MonitoredTrainingSession(step_fn, state=jnp.zeros(()), data=Slow(), checkpoint_dir=workdir,
                                     save_checkpoint_steps=10, save_summaries_steps=5, log_step_count_steps=None,
                                     prefetch=0, hooks=hooks, watchdog_secs={WATCHDOG_SECS} if hang else None) as sess:
        print("START", sess.time_spent.start, sess.restored_step, flush=True)
        while not sess.should_stop():
            sess.run()
""")


def runner(tmp_path):
    """`run(crash_at, *mode)`: one process of the goodput script's run, in `tmp_path / "run"`."""
    script, workdir = tmp_path / "train.py", tmp_path / "run"
    script.write_text(SCRIPT)

    def run(crash_at, *mode):
        return warm_processes.run([sys.executable, str(script), str(workdir), str(crash_at), *mode], cwd=ROOT,
                                  text=True, capture_output=True, timeout=240,
                                  env={**os.environ, "PYTHONUNBUFFERED": "1"})
    return run, workdir


def batch_secs(stdout):
    """{data position: the seconds its batch took} from a run's BATCH lines."""
    return {int(position): float(secs) for _, position, secs in
            (line.split() for line in stdout.splitlines() if line.startswith("BATCH "))}


def test_each_category_is_within_10_percent_of_the_known_time_across_a_restart(tmp_path):
    run, workdir = runner(tmp_path)

    first = run(crash_at=35)  # killed after step 35; its newest checkpoint is step 30
    assert first.returncode == 3, first.stderr[-3000:]
    crashed = float(next(line for line in first.stdout.splitlines() if line.startswith("CRASH")).split()[1])
    second = run(crash_at=0)
    assert second.returncode == 0, second.stderr[-3000:]
    start, restored = next(line for line in second.stdout.splitlines() if line.startswith("START")).split()[1:]
    assert restored == "30"
    evaluations = (first.stdout + second.stdout).splitlines().count("EVALUATION")

    record = json.loads((workdir / "goodput.json").read_text())
    assert record["processes"] == 2
    totals = {k: record["before"][k] + record["process"]["spent"][k] for k in record["before"]}
    # Steps 1-35, then 31-60: 60 batches kept, 5 redone (their time lost). Each batch's and each
    # evaluation batch's known time is what it took, as it measured it (a sleep overruns under load).
    first_batches, second_batches = batch_secs(first.stdout), batch_secs(second.stdout)
    assert sorted(first_batches) == list(range(35)) and sorted(second_batches) == list(range(30, 60))
    kept = sum(secs for position, secs in first_batches.items() if position < 30) + sum(second_batches.values())
    lost = sum(secs for position, secs in first_batches.items() if position >= 30)
    assert kept >= 60 * DATA_SECS and lost >= 5 * DATA_SECS
    assert totals["data"] == pytest.approx(kept, rel=0.1), (kept, totals)
    # The redone steps are lost at the first process's mean step time: its batches' mean wait, and
    # the rest of a step (its dispatch and hooks: the second process's mean, milliseconds when quiet).
    waits = sum(first_batches.values()) / len(first_batches)
    rest = sum(record["process"]["spent"][k] for k in ("productive", "hooks")) / len(second_batches)
    assert 0.9 * 5 * waits <= totals["lost"] <= 1.1 * 5 * (waits + rest) + 0.02, (waits, rest, totals)
    lines = (first.stdout + second.stdout).splitlines()
    evaluated = [float(line.split()[2]) for line in lines if line.startswith("EVALUATION BATCH")]
    whole = [float(line.split()[2]) for line in lines if line.startswith("EVALUATION SECS")]
    assert len(evaluated) == evaluations * 2 and len(whole) == evaluations >= 3
    # The known time of an evaluation: its batches' waits and the evaluation steps between them
    # (milliseconds when quiet; under load, more than a tenth of the waits).
    assert sum(evaluated) <= totals["evaluation"], (evaluated, totals)
    assert totals["evaluation"] == pytest.approx(sum(whole), rel=0.1), (whole, totals)
    # Between the processes: from the first one's last record to the second one's session.
    assert float(start) - crashed <= totals["idle"] <= float(start) - crashed + 1.0, totals
    assert totals["compile"] > 0 and totals["restore"] > 0 and totals["checkpoint"] > 0

    shown = subprocess.run([sys.executable, "-m", "jaxmon", "inspect", str(workdir)], cwd=ROOT, text=True,
                           capture_output=True, timeout=60)
    assert shown.returncode == 0, shown.stderr
    lines = shown.stdout.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("goodput: "))
    assert "over the run's whole life (2 processes, one after the other)" in lines[head]
    table = {line.split()[0]: float(line.split()[1]) for line in lines[head + 1:head + 11]}
    assert list(table) == ["productive", "compile", "init", "restore", "checkpoint", "data", "evaluation", "hooks",
                           "lost", "idle"]
    assert table["data"] == pytest.approx(totals["data"], abs=0.006)
    assert table["lost"] == pytest.approx(totals["lost"], abs=0.006)


def test_the_hang_of_a_run_the_watchdog_ended_is_idle_time_of_the_run(tmp_path):
    run, workdir = runner(tmp_path)
    first = run(15, "hang")  # hangs after step 15 (recorded) until the watchdog ends it
    assert first.returncode == 76, first.stderr[-3000:]
    hung = float(next(line for line in first.stdout.splitlines() if line.startswith("CRASH")).split()[1])
    second = run(0)
    assert second.returncode == 0, second.stderr[-3000:]
    start = float(next(line for line in second.stdout.splitlines() if line.startswith("START")).split()[1])
    record = json.loads((workdir / "goodput.json").read_text())
    idle = record["before"]["idle"]
    # From the hung process's last record (step 15) to the next one's start: the hang, the exit and the restart.
    assert WATCHDOG_SECS <= start - hung <= idle <= start - hung + 1.0, (idle, start - hung)
    assert idle / sum(record["before"].values()) > 0.2, record  # a share of the run's time to see, not 0


def test_a_session_counts_every_second_of_its_life_once():
    """The categories of one session sum to its wall time, and a fresh session's clocks
    start at zero."""
    import jax.numpy as jnp

    def step_fn(state, batch):
        return state + batch, {}

    taken = []  # each batch's seconds, as the data measured them (0.01 s, more under load)

    def data():
        while True:
            start = time.monotonic()
            time.sleep(0.01)
            taken.append(time.monotonic() - start)
            yield 1.0

    with jm.MonitoredSession(step_fn, state=jnp.zeros(()), data=data(), hooks=[jm.StopAtStepHook(last_step=20)],
                             prefetch=0) as sess:
        while not sess.should_stop():
            sess.run()
    before = sess.time_spent.elapsed()
    spent = sess.time_spent.breakdown()
    assert before <= sum(spent.values()) <= sess.time_spent.elapsed()  # its clock reads as it sums, not later
    assert len(taken) == 20 and sum(taken) >= 20 * 0.01
    assert spent["data"] == pytest.approx(sum(taken), rel=0.25) and spent["compile"] > 0
