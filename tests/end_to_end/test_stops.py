"""A stop by SIGTERM, Ctrl-C or SIGHUP at a step that is no checkpoint, evaluation or
summary step keeps the run whole: it saves at the step boundary and ends within one
step and one save, and after the resume `metrics.jsonl` and TensorBoard hold an
uninterrupted run's records, record for record."""

import json
import os
import re
import shutil
import signal
import time

import pytest
from helpers import ROOT, assert_same_checkpoint, run_jaxmon, tiny_config
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import jaxmon as jm
from jaxmon._cli.main import records

STEPS, STOP_AT = 60, 27  # checkpoints and evaluations every 20 steps, summaries every 10
NAME = {signal.SIGINT: "Ctrl-C", signal.SIGTERM: "SIGTERM", signal.SIGHUP: "SIGHUP"}
EXIT = {signal.SIGINT: 130, signal.SIGTERM: 143, signal.SIGHUP: 129}

#: A hook that sends $SIGNAL_AT's signal to its own process after step $SIGNAL_AT_STEP
#: (or in `begin`, while the session is being made: "begin"), as a scheduler would,
#: and writes when (a no-op without them: the whole run).
SIGNAL_AT = '''
import os, signal, time
import jaxmon as jm

class SignalAt(jm.Hook):
    def begin(self):
        if os.environ.get("SIGNAL_AT_STEP") == "begin":
            self._send()

    def after_run(self, ctx, values):
        if os.environ.get("SIGNAL_AT") and os.environ["SIGNAL_AT_STEP"] == str(values.step):
            self._send()

    def _send(self):
        with open(os.environ["SIGNAL_AT_FILE"], "w") as file:
            file.write(repr(time.time()))
        os.kill(os.getpid(), getattr(signal, os.environ["SIGNAL_AT"]))
'''


@pytest.fixture(scope="module")
def config(tmp_path_factory):
    directory = tmp_path_factory.mktemp("stops")
    path = tiny_config(directory, steps=STEPS)
    hooks = '{"name": "NanHook"}, {"name": "signal_at:SignalAt"}'
    path.write_text(path.read_text().replace('{"name": "NanHook"}', hooks))
    (directory / "signal_at.py").write_text(SIGNAL_AT)
    return path


@pytest.fixture(scope="module")
def whole(config):
    """An uninterrupted run of `config`."""
    workdir = config.parent / "whole"
    result = train(config, workdir)
    assert result.returncode == 0, result.stderr[-3000:]
    return workdir


@pytest.fixture(scope="module")
def stop(config):
    """`stop(signum)`: a run of `config` sent `signum` after step STOP_AT, once per signal
    for the module: (its workdir, a copy of the workdir as the stop left it, its
    `CompletedProcess`, the time it ended, the file of the time the signal was sent)."""
    runs = {}

    def stopped_run(signum):
        if signum not in runs:
            workdir, sent = config.parent / signum.name, config.parent / f"{signum.name}.sent"
            result = train(config, workdir, env={"SIGNAL_AT": signum.name, "SIGNAL_AT_STEP": str(STOP_AT),
                                                 "SIGNAL_AT_FILE": str(sent)})
            ended = time.time()
            copy = config.parent / f"{signum.name}.stopped"
            shutil.copytree(workdir, copy)
            runs[signum] = workdir, copy, result, ended, sent
        return runs[signum]

    return stopped_run


def train(config, workdir, env=None):
    return run_jaxmon(["train", "--config", config, "--workdir", workdir], cwd=ROOT, timeout=300,
                      env={**os.environ, **(env or {})})


def is_timing(tag):
    """A value that is a time (different in every run): wall time, goodput, throughput."""
    return tag == "wall_time" or tag.startswith(("goodput/", "perf/")) or tag.endswith("/sec")


def jsonl(workdir):
    """`metrics.jsonl`'s records: (step, {tag: value}), timing values as their tags only."""
    return [(record["step"], {tag: None if is_timing(tag) else value for tag, value in record.items()})
            for record in records(os.fspath(workdir / "metrics.jsonl"))]


def tensorboard(workdir):
    """Each scalar tag's (step, value) points, a timing value's as its step only."""
    events = EventAccumulator(os.fspath(workdir), size_guidance={"scalars": 0})
    events.Reload()
    return {tag: [(event.step, None if is_timing(tag) else event.value) for event in events.Scalars(tag)]
            for tag in events.Tags()["scalars"]}


def stop_secs(stderr):
    """The session's logged seconds from the signal to its stop, and the step it stopped at."""
    logged = re.search(r"Stopped at step (\d+), ([\d.]+) s after ", stderr)
    assert logged, stderr[-3000:]
    return int(logged[1]), float(logged[2])


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP], ids=["sigterm", "ctrl-c", "sighup"])
def test_a_stop_between_checkpoints_resumes_into_a_whole_runs_records(config, whole, stop, signum):
    workdir, _, stopped, ended, sent = stop(signum)
    assert stopped.returncode == EXIT[signum], stopped.stderr[-3000:]
    step, secs = stop_secs(stopped.stderr)
    assert STOP_AT <= step < 30, step  # the step boundary after the signal: no checkpoint, evaluation or summary step
    last = stopped.stderr.strip().splitlines()[-1]
    assert last == (f"jaxmon train: Stopped by {NAME[signum]} at step {step}; checkpoint {step} is saved: run the "
                    "same command to resume."), last
    assert f"Stopped by {NAME[signum]}" not in stopped.stdout  # the stop is said once, on stderr
    assert f"eval at step {step}" not in stopped.stderr  # no evaluation spends the grace period

    # From the signal to the session's stop: one step and one save. The bound is this
    # process's own figures (goodput.json): its mean step, and every save it made (the
    # ones at steps 0 and 20 too), so a loaded machine slows both sides alike.
    process = json.loads((workdir / "goodput.json").read_text())["process"]
    spent = process["spent"]
    one_step = (spent["productive"] + spent["data"] + spent["hooks"]) / process["steps_run"]
    assert secs <= one_step + spent["checkpoint"] + 0.25, (secs, one_step, spent)
    assert ended - float(sent.read_text()) < secs + 10  # and the process ends soon after

    resumed = train(config, workdir)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert jsonl(workdir) == jsonl(whole)
    assert tensorboard(workdir) == tensorboard(whole)
    assert_same_checkpoint(workdir, whole, STEPS)


def test_the_stop_writes_no_record_at_its_step(whole, stop):
    _, workdir, stopped, _, _ = stop(signal.SIGTERM)  # the workdir as the stop left it
    step, _ = stop_secs(stopped.stderr)
    written = [(record["step"], sorted(record)) for record in records(os.fspath(workdir / "metrics.jsonl"))]
    assert written == [(record["step"], sorted(record)) for record in records(os.fspath(whole / "metrics.jsonl"))
                       if record["step"] <= step]  # the whole run's before the stop, nothing at it
    assert written[-1][0] == 20 and "eval/loss" in written[-1][1]
    assert json.loads((workdir / "goodput.json").read_text())["process"]["last_step"] == step


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP], ids=["sigterm", "ctrl-c", "sighup"])
def test_every_signal_while_the_session_is_made_saves_checkpoint_0(config, signum, tmp_path):
    """The same start-up rule for every signal: once the session exists, it takes the
    signal over and saves the step it starts at."""
    workdir = tmp_path / "run"
    stopped = train(config, workdir, env={"SIGNAL_AT": signum.name, "SIGNAL_AT_STEP": "begin",
                                          "SIGNAL_AT_FILE": str(tmp_path / "sent")})
    assert stopped.returncode == EXIT[signum], stopped.stderr[-3000:]
    assert stopped.stderr.strip().splitlines()[-1] == (f"jaxmon train: Stopped by {NAME[signum]} at step 0; "
                                                       "checkpoint 0 is saved: run the same command to resume.")
    assert jm.latest_checkpoint_step(workdir) == 0
