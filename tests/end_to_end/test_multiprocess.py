"""Two real JAX processes on 127.0.0.1 training one model with a sharded session.

Every multi-process decision must be agreed, so that both processes stop, raise, save
and write at the same step. Three launches (JAX start-up costs seconds a process):

* the main launch runs several sessions one after another in the same two processes
  (training with summaries, checkpoints, a chief-only stop and a seconds-based trigger;
  a hook error on one process; a NaN in one process's data; the end of one process's
  data; each process reading its own shard, uninterrupted, then stopped and resumed)
  and ends with a session that process 1 gets SIGTERM in;
* two more (run side by side) have process 1 die (`os._exit`) in the middle of
  training: without checkpoints, and just after starting an (async) checkpoint save.

The workers print one `RESULT {json}` line per session; the tests read those lines and
the artefacts (checkpoints, event files, metrics.jsonl) back.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import warm_processes
from helpers import cpu_env, free_port, window_means, with_helpers_path

import jaxmon as jm

pytestmark = pytest.mark.processes  # every test here runs two JAX processes

WORKER = textwrap.dedent('''
    import json, os, sys, time
    import jaxmon as jm

    pid, address, workdir, scenarios = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4].split(",")
    heartbeat = {"heartbeat_timeout_seconds": int(sys.argv[5])} if len(sys.argv) > 5 else {}
    jm.distributed.initialize(address, num_processes=2, process_id=pid, initialization_timeout=60, **heartbeat)
    import jax, jax.numpy as jnp, numpy as np, optax
    from helpers import RunCounter, step_times  # tests/ is on PYTHONPATH

    assert jax.process_count() == 2 and jax.device_count() == 2
    tx = optax.sgd(0.1)
    mesh = jax.make_mesh((jax.device_count(),), ("data",))

    def init_fn():
        params = {"w": jnp.full((4,), 0.1, jnp.float32)}
        return {"params": params, "opt": tx.init(params)}

    def step_fn(state, batch):
        def loss_fn(params):
            return jnp.mean((batch["x"] @ params["w"] - batch["y"]) ** 2)
        loss, grads = jax.value_and_grad(loss_fn)(state["params"])
        updates, opt = tx.update(grads, state["opt"])
        return {"params": optax.apply_updates(state["params"], updates), "opt": opt}, {"loss": loss}

    def batches(nan_at=None, end_after=None):
        """This process's part of each global batch (4 of its 8 rows): different data
        on each process. `nan_at`: the index of a batch full of NaN; `end_after`: how
        many batches there are (default: endless)."""
        rng = np.random.default_rng(pid)
        i = 0
        while end_after is None or i < end_after:
            x = rng.normal(size=(4, 4)).astype(np.float32)
            y = rng.normal(size=(4,)).astype(np.float32)
            if i == nan_at:
                x[:] = np.nan
            yield {"x": x, "y": y}
            i += 1

    def host(array):  # a replicated global array, as this process sees it
        return np.asarray(array.addressable_data(0))

    class StopAt(jm.Hook):
        def __init__(self, step):
            self.stop_step = step
        def after_run(self, ctx, values):
            if values.step == self.stop_step:
                ctx.request_stop()

    class Sleep(jm.Hook):
        def __init__(self, secs):  # seconds, or seconds for each step
            self.secs = secs
        def after_run(self, ctx, values):
            time.sleep(self.secs if np.ndim(self.secs) == 0 else self.secs[values.step])

    class Losses(jm.Hook):  # this process's view of every step's (global) loss
        def __init__(self):
            self.losses = {}
        def after_run(self, ctx, values):
            self.losses[values.step] = float(host(values.outputs["loss"]))

    class FailAt(jm.Hook):  # a process-local check, as a NaN check on local data would do
        def __init__(self, step):
            self.fail_step = step
        def after_run(self, ctx, values):
            if values.step == self.fail_step:
                raise ValueError(f"local check on process {pid} failed at step {values.step}")

    class Progress(jm.Hook):
        def after_run(self, ctx, values):
            print(f"STEP {values.step}", flush=True)

    class Die(jm.Hook):
        def __init__(self, step):
            self.die_step = step
        def after_run(self, ctx, values):
            if values.step == self.die_step:
                print(f"DYING at {values.step}", flush=True)
                os._exit(3)

    def report(name, open_session, after_run=lambda sess: None, extra=None):
        """Runs the session `open_session()` opens until it stops (`after_run(sess)` after
        each run) and prints its `RESULT` line: how it ended, its step and state."""
        result = {"scenario": name, "process": pid}
        sess = None
        start = time.monotonic()
        try:
            with open_session() as sess:
                while not sess.should_stop():
                    sess.run()
                    after_run(sess)
            result["ok"] = True
        except Exception as error:
            result.update(ok=False, error_type=type(error).__name__, error=str(error),
                          error_step=getattr(error, "step", None))
        result["secs"] = round(time.monotonic() - start, 2)
        if sess is not None:
            result.update(step=sess.step, preempted=sess.preemption_requested, agreements=sess._agreed.rounds)
            if not sess.state["params"]["w"].is_deleted():  # a step that failed consumed its (donated) state
                result["w"] = [float(v) for v in host(sess.state["params"]["w"])]
        result.update(extra or {})
        print("RESULT " + json.dumps(result), flush=True)

    def train(name, data, *, hooks=(), chief_only_hooks=(), extra=None, last_step=1000, save_checkpoint_steps=5,
              directory=None):
        losses = Losses()
        report(name, lambda: jm.MonitoredTrainingSession(
            step_fn, init_fn, data=data, mesh=mesh, checkpoint_dir=os.path.join(workdir, directory or name),
            chief_only_hooks=list(chief_only_hooks),
            hooks=[jm.NanHook("loss"), jm.StopAtStepHook(last_step=last_step), losses, *hooks],
            save_summaries_steps=5, save_checkpoint_steps=save_checkpoint_steps, log_step_count_steps=5),
            extra={"losses": losses.losses, **(extra or {})})

    class Seen:  # this process's part of each global batch (4 of 8 rows), recording the row ids it yields
        def __init__(self):
            rng = np.random.default_rng(3)
            rows = {"x": rng.normal(size=(32, 4)).astype(np.float32), "y": rng.normal(size=(32,)).astype(np.float32),
                    "id": np.arange(32, dtype=np.int32)}
            self.source, self.ids = jm.ArrayDataSource(rows, 4, shard="process", seed=5), []
        def __iter__(self):
            return self
        def __next__(self):
            batch = next(self.source)
            self.ids.append([int(i) for i in batch["id"]])
            return batch
        def get_state(self):
            return self.source.get_state()
        def set_state(self, state):
            self.source.set_state(state)

    class Poisoned(Seen):  # process 1's batch at data position 36 (step 37's) is NaN
        def __next__(self):
            position = self.source.get_state()
            batch = super().__next__()
            if pid == 1 and position["epoch"] * 4 + position["index"] == 36:
                batch = {**batch, "x": np.full_like(batch["x"], np.nan)}
            return batch

    def quiet(name, data, *, chief_stop_at=None, chief_only_hooks=(), die_at=None, pause=0.0, agree_every=8,
              hooks=()):
        """The default set with NanHook, agreeing every 8 steps: no hook of either process
        acts between step 1 and step 100. `chief_stop_at`: the chief's loop asks to stop
        after that step (no hook's trigger); `die_at`: process 1 dies after that step;
        `pause`: the loop sleeps this long after each run and prints the step. Its result's
        `hosts`: both processes' host seconds per step, as each agreement had them."""
        hosts = []

        def after_run(sess):
            agreed = list(sess._agreed.stragglers.host_per_step)
            if agreed and agreed not in hosts[-1:]:
                hosts.append(agreed)
            if pid == 0 and sess.step == chief_stop_at:
                sess.request_stop()
            if pid == 1 and sess.step == die_at:
                print(f"DYING at {sess.step}", flush=True)
                os._exit(3)
            if pause:
                print(f"STEP {sess.step}", flush=True)
                time.sleep(pause)

        report(name, lambda: jm.MonitoredTrainingSession(
            step_fn, init_fn, data=data, mesh=mesh, checkpoint_dir=os.path.join(workdir, name),
            hooks=[jm.NanHook("loss"), jm.StopAtStepHook(last_step=1000), *hooks],
            chief_only_hooks=list(chief_only_hooks), agree_every_n_steps=agree_every), after_run,
            extra={"hosts": hosts})

    def slow():
        """A step of tens of milliseconds with a collective (the mean of a batch sharded over
        both processes): one step's time, alone, against dispatching 5 runs of the default
        set + LoggingHook + NanHook between agreement points."""
        from jax.sharding import NamedSharding, PartitionSpec as P
        size, count = 384, 30

        def slow_step(state, batch):
            x = jax.lax.fori_loop(0, count, lambda i, x: jnp.tanh(x @ x), state)
            return x, {"loss": x[0, 0] + jnp.mean(batch["x"])}

        local = {"x": np.ones((2,), np.float32)}
        one = jax.jit(slow_step)
        state = jax.device_put(np.eye(size, dtype=np.float32) * 0.5, NamedSharding(mesh, P()))
        batch = {"x": jax.make_array_from_process_local_data(NamedSharding(mesh, P("data")), local["x"])}
        one_step = step_times(one, state, batch)
        with jm.MonitoredTrainingSession(
                slow_step, lambda: jnp.eye(size, dtype=jnp.float32) * 0.5, data=iter(lambda: local, None),
                mesh=mesh, checkpoint_dir=os.path.join(workdir, "slow"), agree_every_n_steps=16,
                hooks=[jm.LoggingHook(["loss"], every_n_iter=100), jm.NanHook("loss"),
                       jm.StopAtStepHook(last_step=14)]) as sess:
            for _ in range(3):  # step 1 is a trigger (summaries, the first log line, the first read)
                sess.run()
            jax.block_until_ready(sess.state)
            compiled, agreements = sess.compile_count, sess._agreed.rounds
            start = time.perf_counter()
            with jax.transfer_guard("disallow"):  # their batches went to the mesh ahead: no copy either way
                for _ in range(5):  # steps 4 to 8: no hook of either process acts before step 100; agreements 13, 14
                    sess.run()
            dispatch_five = time.perf_counter() - start
            jax.block_until_ready(sess.state)
            result = {"scenario": "slow", "process": pid, "one_step": one_step, "dispatch_five": dispatch_five,
                      "compiled": sess.compile_count - compiled, "agreements": sess._agreed.rounds - agreements}
            while not sess.should_stop():
                sess.run()
        result["step"] = sess.step
        print("RESULT " + json.dumps(result), flush=True)

    for scenario in scenarios:
        if scenario == "slow":
            slow()
        elif scenario == "stop_loop13":  # the chief's own loop asks to stop after step 13
            quiet(scenario, batches(), chief_stop_at=13)
        elif scenario == "stop_hook13":  # a chief-only hook asks to stop at its trigger, step 13
            quiet(scenario, batches(), chief_only_hooks=[jm.StopAtStepHook(last_step=13)])
        elif scenario == "eod21":  # process 1 has 21 batches, process 0 endless
            quiet(scenario, batches(end_after=21 if pid == 1 else None))
        elif scenario == "sigterm_quiet":  # the test sends SIGTERM to process 1 between agreement points
            quiet(scenario, batches(), pause=0.01)
        elif scenario == "die_quiet":  # process 1 dies after step 5, between agreement points
            quiet(scenario, batches(), die_at=5)
        elif scenario == "nan37":  # batch 36 (step 37) of process 1 is NaN
            quiet(scenario, batches(nan_at=36 if pid == 1 else None))
        elif scenario.startswith("shards"):  # full: to step 12; half: to 6, then resume: to 12 from its checkpoint
            seen = Seen()
            last_step = 6 if scenario == "shards_half" else 12
            train(scenario, seen, last_step=last_step, extra={"ids": seen.ids},
                  directory="shards_full" if scenario == "shards_full" else "shards")
        elif scenario == "train":  # chief-only summaries and stop, checkpoints, a seconds-based trigger
            fired, fired_at = [], []  # the steps it fired at, and when (this process's clock)

            def fire(session):
                fired.append(session.step)
                fired_at.append(time.monotonic())

            periodic = jm.PeriodicHook(fire, every_n_secs=0.1)
            # Process 1 reaches the trigger a varying time into each step: its own clock
            # would fire at other steps than the chief's.
            jitter = [Sleep(np.random.default_rng(7).uniform(0, 0.05, 1000))] if pid == 1 else []
            # RunCounter comes after the saver: its state in checkpoint N must be N.
            train("train", batches(), hooks=[*jitter, periodic, RunCounter()],
                  chief_only_hooks=[StopAt(30), Sleep(0.03)], extra={"fired": fired, "fired_at": fired_at})
        elif scenario == "rollback37":  # process 1's batch of step 37 is NaN: both roll back to 30, past it
            guard, counts = jm.NanHook("loss", on_nan="rollback"), {}
            report(scenario, lambda: jm.MonitoredTrainingSession(
                step_fn, init_fn, data=Poisoned(), mesh=mesh, checkpoint_dir=os.path.join(workdir, scenario),
                hooks=[guard, jm.StopAtStepHook(last_step=60)], save_summaries_steps=None, save_checkpoint_steps=10,
                log_step_count_steps=None), lambda sess: counts.update(guard.get_state()["counts"]), extra=counts)
        elif scenario == "straggler":  # process 1's data takes 20 ms a batch: its host holds process 0 up
            # Agreeing every 8 steps: in between, process 0 waits for it on the device too (its host
            # time) for part of the interval, the more of it the shorter the interval: process 1's
            # host time is ~1.6x process 0's at 4 steps, ~2x at 8 (under load too), 1.5x names it.
            data = (time.sleep(0.02) or batch for batch in batches()) if pid == 1 else batches()
            quiet(scenario, data, chief_only_hooks=[jm.StopAtStepHook(last_step=48)], agree_every=8)
        elif scenario == "uneven_hooks":  # the chief's own hook takes 20 ms a run: hook work, not a straggler
            quiet(scenario, batches(), chief_only_hooks=[jm.StopAtStepHook(last_step=40), Sleep(0.02)], agree_every=4)
        elif scenario == "hook_error":  # a hook of process 1 only raises at step 8
            train("hook_error", batches(), hooks=[FailAt(8)] if pid == 1 else [])
        elif scenario == "nan":  # batch 9 (step 10) of process 1 is NaN: the global loss is NaN
            train("nan", batches(nan_at=9 if pid == 1 else None))
        elif scenario == "eod":  # process 1 has 12 batches, process 0 endless
            train("eod", batches(end_after=12 if pid == 1 else None))
        elif scenario == "sigterm":  # the test sends SIGTERM to process 1 while this trains
            train("sigterm", batches(), hooks=[Progress(), Sleep(0.01)], last_step=10**6)
        elif scenario == "die":  # process 1 dies at step 5, just after starting to save it
            train("die", batches(), hooks=[Die(5)] if pid == 1 else [])
        elif scenario == "die_no_checkpoints":  # process 1 dies at step 6; no saves
            train("die_no_checkpoints", batches(), hooks=[Die(6)] if pid == 1 else [], save_checkpoint_steps=None)
        else:
            raise ValueError(scenario)
    print("WORKER DONE", flush=True)
''')


class Workers:
    """Two worker processes; their merged stdout/stderr read line by line by threads."""

    def __init__(self, tmp_path: Path, scenarios: list[str], *extra_args: str):
        script = tmp_path / "worker.py"
        script.write_text(WORKER)
        self.workdir = tmp_path / "runs"
        address = f"127.0.0.1:{free_port()}"
        self.lines: list[list[str]] = [[], []]
        self.times: list[list[float]] = [[], []]  # when each line was read
        self.eof_time: list[float | None] = [None, None]  # when the output ended (the process exited)
        self.processes = [
            warm_processes.popen([sys.executable, str(script), str(i), address, str(self.workdir), ",".join(scenarios),
                                  *extra_args],
                                 env=with_helpers_path(cpu_env()), stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True)
            for i in range(2)]
        self.readers = [threading.Thread(target=self._read, args=(i,), daemon=True) for i in range(2)]
        for reader in self.readers:
            reader.start()

    def _read(self, i: int) -> None:
        for line in self.processes[i].stdout:
            self.times[i].append(time.monotonic())
            self.lines[i].append(line.rstrip("\n"))
        self.eof_time[i] = time.monotonic()

    def wait_for_line(self, i: int, predicate, timeout: float) -> float:
        """Waits for a line of worker i that matches; returns when it was read."""
        deadline = time.monotonic() + timeout
        seen = 0
        while time.monotonic() < deadline:
            done = not self.readers[i].is_alive()
            lines = self.lines[i]
            for n in range(seen, len(lines)):
                if predicate(lines[n]):
                    return self.times[i][n]
                seen = n + 1
            if done:
                break
            time.sleep(0.02)
        raise AssertionError(f"worker {i} printed no matching line within {timeout} s:\n{self.output(i)}")

    def wait(self, i: int, timeout: float) -> int:
        try:
            rc = self.processes[i].wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"worker {i} did not exit within {timeout} s:\n{self.output(i)}") from None
        self.readers[i].join(timeout=10)
        return rc

    def output(self, i: int) -> str:
        return "\n".join(self.lines[i][-60:])

    def results(self, i: int) -> dict[str, dict]:
        return {r["scenario"]: r for r in (json.loads(line[len("RESULT "):]) for line in self.lines[i]
                                          if line.startswith("RESULT "))}

    def kill(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.kill()
                process.wait(timeout=10)


@pytest.fixture(scope="module")
def main_run(tmp_path_factory):
    """The main launch: sessions one after the other in the same two processes, then
    SIGTERM to process 1 in the last; gives the workers, exited, with `rcs` and `exit_secs` (from SIGTERM to
    the last exit)."""
    scenarios = ["train", "hook_error", "nan", "eod", "shards_full", "shards_half", "shards_resume", "stop_loop13",
                 "stop_hook13", "eod21", "nan37", "rollback37", "straggler", "uneven_hooks", "slow", "sigterm"]
    workers = Workers(tmp_path_factory.mktemp("multiprocess"), scenarios)
    try:
        # Both step in lockstep; process 1 is well into the last session's training.
        # Sixteen sessions first: ~35 s at load 5, 95 s in a loaded suite; 300 s is a hang.
        workers.wait_for_line(1, lambda line: line == "STEP 20", timeout=300)
        signalled = time.monotonic()
        workers.processes[1].send_signal(signal.SIGTERM)
        rcs = [workers.wait(i, timeout=30) for i in (1, 0)]
        workers.exit_secs = time.monotonic() - signalled
        workers.rcs = rcs[::-1]
        yield workers
    finally:
        workers.kill()


def single_device_state() -> dict:
    """The workers' state structure, on this process's one device."""
    import jax.numpy as jnp
    import optax
    params = {"w": jnp.zeros((4,), jnp.float32)}
    return {"params": params, "opt": optax.sgd(0.1).init(params)}


def session_lines(workers: Workers, i: int, scenario: str) -> list[str]:
    """Worker i's lines of one scenario's session: those after the RESULT line of the one
    before it, up to its own."""
    lines, start = workers.lines[i], 0
    for n, line in enumerate(lines):
        if line.startswith("RESULT "):
            if json.loads(line[len("RESULT "):])["scenario"] == scenario:
                return lines[start:n + 1]
            start = n + 1
    raise AssertionError(f"no result for {scenario!r}:\n{workers.output(i)}")


def both(workers: Workers, scenario: str) -> list[dict]:
    results = [workers.results(i).get(scenario) for i in range(2)]
    assert all(results), f"no result for {scenario!r}:\n{workers.output(0)}\n---\n{workers.output(1)}"
    return results


@pytest.mark.slow
def test_training_chief_summaries_checkpoints_and_chief_only_stop(main_run):
    p0, p1 = both(main_run, "train")
    assert p0["ok"] and p1["ok"], (p0, p1)
    # The chief-only hook asked to stop at step 30: both stopped there, with one state.
    assert p0["step"] == p1["step"] == 30
    assert p0["w"] == p1["w"] and p0["w"] != [0.1] * 4
    assert p0["losses"] == p1["losses"] and sorted(map(int, p0["losses"])) == list(range(1, 31))
    run = main_run.workdir / "train"
    # Summaries: the chief's only.
    events = sorted(run.rglob("events.out.tfevents*"))
    assert len(events) == 1 and events[0].parent == run, events
    assert sorted(run.rglob("metrics.jsonl")) == [run / "metrics.jsonl"]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    loss_rows = {row["step"]: row["loss"] for row in rows if "loss" in row}
    assert sorted(loss_rows) == [1, 5, 10, 15, 20, 25, 30], rows  # save_summaries_steps=5: step 1, then every 5
    # The default SummarySaverHook writes each output's mean since its previous write:
    # the (global) losses of step 1, then steps 1-5 (the write after step 1 ends no window),
    # 6-10, ... as both processes saw them.
    means = dict(zip(sorted(loss_rows), window_means({int(t): v for t, v in p0["losses"].items()},
                                                     sorted(loss_rows)), strict=True))
    assert means[1] == p0["losses"]["1"]  # step 1 alone
    assert loss_rows == {step: pytest.approx(means[step], rel=1e-6) for step in loss_rows}, (loss_rows, p0["losses"])
    # Checkpoints: every 5 steps, and the last at the stop step; it restores here.
    assert jm.latest_checkpoint_step(run) == 30
    steps = sorted(int(d.name) for d in run.iterdir() if d.name.isdigit())
    assert steps[-2:] == [25, 30] and all(step % 5 == 0 for step in steps), steps
    restored = jm.restore_checkpoint(run, like=single_device_state())  # the test's one device
    assert restored.step == 30 and restored.meta["step"] == 30
    assert type(restored.state["opt"]) is type(single_device_state()["opt"])
    # Each checkpoint holds the state of a hook after the saver as of its own step.
    from jaxmon._checkpoints.step_dirs import read_meta

    counts = {step: [v for k, v in read_meta(run / str(step))["hooks"].items() if k.startswith("RunCounter")]
              for step in steps}
    assert counts == {step: [{"count": step}] for step in steps}, counts
    np.testing.assert_array_equal(np.asarray(restored.state["params"]["w"]), np.asarray(p0["w"], np.float32))


def test_checkpoint_of_two_processes_restores_without_like(main_run):
    # restore_checkpoint's docstring: "like: ... None gives nested dicts of arrays".
    p0, _ = both(main_run, "train")
    restored = jm.restore_checkpoint(main_run.workdir / "train")
    assert restored.step == 30
    np.testing.assert_array_equal(np.asarray(restored.state["params"]["w"]), np.asarray(p0["w"], np.float32))


def test_seconds_based_trigger_fires_at_the_same_steps_on_both(main_run):
    p0, p1 = both(main_run, "train")
    # every_n_secs=0.1 with >= 0.03 s a step (the chief sleeps): several firings, about one per
    # 0.1 s on the chief's clock (not every step, unless the machine's load makes a step 0.1 s).
    assert p0["fired"] == p1["fired"], (p0["fired"], p1["fired"])
    span = p0["fired_at"][-1] - p0["fired_at"][0]
    assert 3 <= len(p0["fired"]) <= span / 0.1 + 2, (p0["fired"], span)
    assert p0["fired"][0] == 1 and p0["fired"] == sorted(set(p0["fired"]))


def test_hook_error_on_one_process_stops_both_at_that_step(main_run):
    p0, p1 = both(main_run, "hook_error")
    assert p1["error_type"] == "ValueError" and "local check on process 1 failed at step 8" in p1["error"], p1
    assert p0["error_type"] == "PeerError", p0
    assert "JAX process 1 failed after step 8" in p0["error"], p0
    assert "local check on process 1 failed at step 8" in p0["error"], p0
    assert p0["step"] == p1["step"] == 8
    assert p0["w"] == p1["w"]
    run = main_run.workdir / "hook_error"
    assert jm.latest_checkpoint_step(run) == 5  # nothing after the failure


def test_nan_in_one_process_data_raises_on_both_at_one_step(main_run):
    p0, p1 = both(main_run, "nan")
    for result in (p0, p1):
        assert result["error_type"] == "NanLossDuringTrainingError", result
        assert result["error_step"] == 10 and "at step 10" in result["error"], result
    assert p0["step"] == p1["step"] >= 10
    run = main_run.workdir / "nan"
    # Step 10 is a checkpoint step, but its state is NaN: it is not saved.
    assert jm.latest_checkpoint_step(run) == 5
    restored = jm.restore_checkpoint(run, like=single_device_state())
    assert np.isfinite(np.asarray(restored.state["params"]["w"])).all()


def test_a_nan_in_one_process_data_rolls_both_back_together_past_its_batch(main_run):
    p0, p1 = both(main_run, "rollback37")
    for result in (p0, p1):
        assert result["ok"] and result["step"] == 60, result
        assert result["rollbacks"] == 1 and result["skipped_batches"] == 7 and result["nan_steps"] == 1, result
        assert np.isfinite(result["w"]).all()
    assert p0["w"] == p1["w"]  # one state: they rolled back to the same checkpoint and went on in step
    assert jm.latest_checkpoint_step(main_run.workdir / "rollback37") == 60
    for i in (0, 1):
        assert any("Rolled back to step 30 for the bad step 37: the batches of steps 31 to 37 are skipped" in line
                   for line in main_run.lines[i]), main_run.output(i)


def test_a_process_whose_data_is_slow_is_named_a_straggler_by_the_chief_and_the_chiefs_hooks_never(main_run):
    p0, p1 = both(main_run, "straggler")
    assert p0["ok"] and p1["ok"] and p0["step"] == p1["step"] == 48
    # Process 1 named once, by the chief (a warning), in its session, with its 20 ms a batch; the other
    # process logs it at INFO (not shown here: the workers print warnings only): one line per event.
    said = [line for line in session_lines(main_run, 0, "straggler") if "is a straggler" in line]
    assert len(said) == 1 and "Process 1 is a straggler: " in said[0], main_run.output(0)
    assert "the median of the other process" in said[0]
    assert float(said[0].split("straggler: ")[1].split(" ms")[0]) > 15, said[0]
    assert not [line for line in session_lines(main_run, 1, "straggler") if "is a straggler" in line]
    records = [json.loads(line) for line in (main_run.workdir / "straggler" / "metrics.jsonl").read_text().splitlines()]
    [report] = [r for r in records if r.get("stragglers/slowest_process") == 1.0]
    assert report["stragglers/process_1_ms_per_step"] > 15
    # The chief's hook sleeps 20 ms every run, and every run is an agreement: counted, its host
    # time per step would be 20 ms above process 1's at every one. Load makes either process slower
    # than the other now and then (and a straggler for a while): the hook time, never.
    p0, p1 = both(main_run, "uneven_hooks")
    assert p0["ok"] and p1["ok"] and p0["step"] == p1["step"] == 40
    hosts = p0["hosts"][1:]  # the first: start-up's
    assert len(hosts) >= 20 and p0["hosts"] == p1["hosts"], (p0["hosts"], p1["hosts"])
    assert np.median([chief - other for chief, other in hosts]) < 0.01, hosts


def test_end_of_data_on_one_process_stops_both_cleanly(main_run):
    p0, p1 = both(main_run, "eod")
    assert p0["ok"] and p1["ok"], (p0, p1)
    assert p0["step"] == p1["step"] == 12
    assert p0["w"] == p1["w"]
    run = main_run.workdir / "eod"
    assert jm.latest_checkpoint_step(run) == 12
    restored = jm.restore_checkpoint(run, like=single_device_state())
    np.testing.assert_array_equal(np.asarray(restored.state["params"]["w"]), np.asarray(p0["w"], np.float32))


def saved_one_step_and_exited(workers: Workers, scenario: str) -> None:
    """After SIGTERM to process 1 past step 20: both exited cleanly within 10 s, preempted
    at one step with one state, which they saved and which restores."""
    p0, p1 = both(workers, scenario)
    assert workers.rcs == [0, 0], (workers.rcs, workers.output(0), workers.output(1))
    assert workers.exit_secs < 10, workers.exit_secs
    assert p0["ok"] and p1["ok"] and p0["preempted"] and p1["preempted"], (p0, p1)
    assert p0["step"] == p1["step"] > 20
    assert p0["w"] == p1["w"]
    run = workers.workdir / scenario
    assert jm.latest_checkpoint_step(run) == p0["step"]
    restored = jm.restore_checkpoint(run, like=single_device_state())
    np.testing.assert_array_equal(np.asarray(restored.state["params"]["w"]), np.asarray(p0["w"], np.float32))


def test_sigterm_to_the_non_chief_saves_one_step_on_both_and_exits_cleanly(main_run):
    saved_one_step_and_exited(main_run, "sigterm")
    assert all("WORKER DONE" in main_run.lines[i] for i in range(2))


# -- agreement points: no host sync between them -------------------------------------------------


def reference_w(steps: int) -> np.ndarray:
    """The workers' `w` after `steps` steps of SGD on the global batches of `batches()`
    (process 0's 4 rows, then process 1's), computed here in NumPy."""
    rngs = [np.random.default_rng(p) for p in range(2)]
    w = np.full((4,), 0.1, np.float64)
    for _ in range(steps):
        parts = [(rng.normal(size=(4, 4)).astype(np.float32), rng.normal(size=(4,)).astype(np.float32)) for rng in rngs]
        x, y = np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])
        w = w - 0.1 * 2 * x.T @ (x @ w - y) / len(y)
    return w


def stopped_together(workers: Workers, scenario: str, step: int, agreements: int) -> list[dict]:
    """Both processes of `scenario` stopped cleanly at `step` after `agreements` agreements,
    with the state of `step` steps on every global batch, saved there."""
    p0, p1 = both(workers, scenario)
    assert p0["ok"] and p1["ok"], (p0, p1)
    assert p0["step"] == p1["step"] == step
    assert p0["agreements"] == p1["agreements"] == agreements, (p0, p1)
    assert p0["w"] == p1["w"]
    np.testing.assert_allclose(p0["w"], reference_w(step), rtol=1e-5)
    run = workers.workdir / scenario
    assert jm.latest_checkpoint_step(run) == step
    restored = jm.restore_checkpoint(run, like=single_device_state())
    np.testing.assert_array_equal(np.asarray(restored.state["params"]["w"]), np.asarray(p0["w"], np.float32))
    return [p0, p1]


def test_a_stop_request_between_agreement_points_stops_both_at_the_next_one(main_run):
    # agree_every_n_steps=8; the chief's loop asks to stop after step 13, which no hook's
    # trigger marks: both stop at 16, the next multiple of 8. Agreements: before the first
    # run, after step 1 (the summaries' and NanHook's first trigger), after 8 and 16; none
    # at the steps between.
    stopped_together(main_run, "stop_loop13", step=16, agreements=4)


def test_a_chief_only_hook_stops_both_at_its_own_trigger_step(main_run):
    # A chief-only StopAtStepHook(last_step=13): its step-based trigger is known to every
    # process at the agreement before it, so both stop at 13 exactly. Agreements: before
    # the first run; after 1, 8, 12 and 13.
    stopped_together(main_run, "stop_hook13", step=13, agreements=5)


def test_end_of_data_on_one_process_between_agreement_points_stops_both_with_nothing_lost(main_run):
    # Process 1 has 21 batches; at the agreement after step 16 it has 5 taken ahead, so
    # both agree again after step 21 and stop there: every batch of process 1 ran, once
    # (the state is that of 21 steps). Agreements: before the first run; after 1, 8, 16, 21.
    stopped_together(main_run, "eod21", step=21, agreements=5)
    assert not np.allclose(reference_w(20), reference_w(21), rtol=1e-3)  # one batch more or less shows


def test_a_nan_between_agreement_points_raises_on_both_with_its_exact_step(main_run):
    # Process 1's batch of step 37 is NaN (so is the global loss). NanHook's check runs on
    # the device; the read that sees it (NanHook's and the summaries' trigger at step 100)
    # is an agreement point: both raise there, naming step 37.
    p0, p1 = both(main_run, "nan37")
    for result in (p0, p1):
        assert result["error_type"] == "NanLossDuringTrainingError", result
        assert result["error_step"] == 37 and "at step 37" in result["error"], result
    assert p0["step"] == p1["step"] == 100
    run = main_run.workdir / "nan37"
    assert jm.latest_checkpoint_step(run) < 37  # the save at close refused the NaN state
    restored = jm.restore_checkpoint(run, like=single_device_state())
    assert np.isfinite(np.asarray(restored.state["params"]["w"])).all()


def test_runs_between_agreement_points_dispatch_without_waiting_on_two_processes(main_run):
    # A step of tens of milliseconds whose loss is a collective over both processes' rows;
    # the default set + LoggingHook + NanHook: 5 runs between agreement points dispatch in
    # less than one step executes, copy nothing implicitly, compile nothing and agree nothing.
    for result in both(main_run, "slow"):
        assert result["compiled"] == 0 and result["agreements"] == 0, result
        assert result["dispatch_five"] < min(result["one_step"]), result
        assert result["step"] == 14


@pytest.fixture(scope="module")
def quiet_sigterm_run(tmp_path_factory):
    """A launch that trains agreeing every 8 steps; SIGTERM to process 1 once it printed
    step 20. Gives the workers, exited, with `rcs` and `exit_secs`."""
    workers = Workers(tmp_path_factory.mktemp("sigterm_quiet"), ["sigterm_quiet"])
    try:
        workers.wait_for_line(1, lambda line: line == "STEP 20", timeout=240)
        signalled = time.monotonic()
        workers.processes[1].send_signal(signal.SIGTERM)
        workers.rcs = [workers.wait(i, timeout=30) for i in (0, 1)]
        workers.exit_secs = time.monotonic() - signalled
        yield workers
    finally:
        workers.kill()


def test_sigterm_between_agreement_points_saves_one_step_on_both(quiet_sigterm_run):
    # JAX's preemption sync point is polled after every run, quiet ones too: both processes
    # stop at the step it agreed on, save it, and exit cleanly.
    saved_one_step_and_exited(quiet_sigterm_run, "sigterm_quiet")


# JAX declares a silent peer dead after `heartbeat_timeout_seconds` (default 100 s) and
# then aborts the survivors; the launches where a process dies shorten it to keep the
# test short (jm.distributed.initialize passes it on to jax.distributed.initialize).
HEARTBEAT_SECS = 10
DIE_STEP = {"die_no_checkpoints": 6, "die": 5, "die_quiet": 5}


@pytest.fixture(scope="module")
def die_runs(tmp_path_factory):
    """Three launches at once, in each of which process 1 dies (`os._exit(3)`): in a hook,
    without checkpoints; in a hook, just after starting the (async, collective) save of
    that step; in its loop between agreement points. Gives {scenario: (workers, when
    process 1 died, [rc of 0, rc of 1])}."""
    launches = {scenario: Workers(tmp_path_factory.mktemp(scenario), [scenario], str(HEARTBEAT_SECS))
                for scenario in DIE_STEP}
    try:
        runs = {}
        for scenario, workers in launches.items():
            died = workers.wait_for_line(1, lambda line, s=scenario: line == f"DYING at {DIE_STEP[s]}", timeout=240)
            rc1 = workers.wait(1, timeout=30)
            try:
                rc0 = workers.processes[0].wait(timeout=max(1.0, died + 40 - time.monotonic()))
            except subprocess.TimeoutExpired:
                rc0 = None  # still running: hung
            workers.readers[0].join(timeout=10)
            runs[scenario] = (workers, died, [rc0, rc1])
        yield runs
    finally:
        for workers in launches.values():
            workers.kill()


@pytest.mark.parametrize("scenario", ["die_no_checkpoints", "die"])
def test_a_dead_process_makes_the_other_fail_fast_with_a_clear_error(die_runs, scenario):
    workers, died, rcs = die_runs[scenario]
    output = workers.output(0)
    assert rcs[1] == 3
    # The survivor raises a clear PeerError at once, at the step the peer died in ...
    result = workers.results(0).get(scenario)
    assert result is not None, f"process 0 printed no result; its output:\n{output}"
    assert result["error_type"] == "PeerError" and result["step"] == DIE_STEP[scenario], result
    assert "stopped answering" in result["error"] and "died" in result["error"], result
    assert "PeerError" in output
    reported = workers.wait_for_line(0, lambda line: line.startswith("RESULT "), timeout=1)
    assert reported - died < 5, reported - died
    # ... and is not left hanging: it skips JAX's shutdown barrier (which would wait for
    # the dead peer, then abort with a native dump) and ends with the peer-lost code.
    assert rcs[0] == jm.distributed.PEER_LOST_EXIT_CODE, (rcs, output)
    assert "Check failure" not in output
    assert workers.eof_time[0] - died < 30, workers.eof_time[0] - died


def test_a_process_dying_between_agreement_points_makes_the_other_fail_fast_with_a_clear_error(die_runs):
    # Process 1 dies after step 5; the next agreement point is 8. A step's collective
    # fails on the survivor (the peer is gone), and the session raises PeerError at once,
    # at the latest at that agreement point.
    workers, died, rcs = die_runs["die_quiet"]
    output = workers.output(0)
    assert rcs[1] == 3
    result = workers.results(0).get("die_quiet")
    assert result is not None, f"process 0 printed no result; its output:\n{output}"
    assert result["error_type"] == "PeerError" and 5 <= result["step"] <= 8, result
    assert "stopped answering" in result["error"] and "died" in result["error"], result
    reported = workers.wait_for_line(0, lambda line: line.startswith("RESULT "), timeout=1)
    assert reported - died < 5, reported - died
    assert rcs[0] == jm.distributed.PEER_LOST_EXIT_CODE, (rcs, output)
    assert "Check failure" not in output
    assert workers.eof_time[0] - died < 30, workers.eof_time[0] - died


def test_each_process_reads_its_own_shard_and_resumes_it_exactly(main_run):
    full, half, resumed = (both(main_run, name) for name in ("shards_full", "shards_half", "shards_resume"))
    for results in (full, half, resumed):
        assert all(r["ok"] for r in results), results
    # Each process reads its 4 rows of every global batch of 8 (ArrayDataSource(shard="process")):
    # the two parts are disjoint, and an epoch (4 steps) covers the 32 rows once.
    steps = [full[0]["ids"][k] + full[1]["ids"][k] for k in range(8)]
    assert all(len(set(batch)) == 8 for batch in steps)
    assert sorted(sum(steps[:4], [])) == sorted(sum(steps[4:], [])) == list(range(32))
    # The checkpoint keeps every process's position: one global position, the same on both.
    from jaxmon._checkpoints.step_dirs import read_meta

    meta = read_meta(main_run.workdir / "shards" / "6")
    assert meta["data_by_process"] == [meta["data"]] * 2 and meta["data"]["global_batch"] == 8
    assert resumed[0]["ids"][0] == full[0]["ids"][6] and resumed[1]["ids"][0] == full[1]["ids"][6]
    # Steps 7-12 after the resume are those of the uninterrupted run, and so is the state.
    for p in range(2):
        assert resumed[p]["losses"] == {str(t): full[p]["losses"][str(t)] for t in range(7, 13)}
        assert resumed[p]["w"] == full[p]["w"]
    assert full[0]["w"] == full[1]["w"]
