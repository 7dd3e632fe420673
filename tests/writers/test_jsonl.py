"""JsonlWriter: metrics.jsonl, one line per step, whoever writes to it, non-finite values
as strings, the hyper-parameters' first line; read back as JSON."""

import errno
import json
import math
import os
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest
from helpers import FakeClock, event_files, float_zero, read_events, read_jsonl, run_summaries

import jaxmon as jm
from jaxmon._writers.jsonl import _write_error


def test_two_hooks_writing_one_step_share_one_jsonl_line(tmp_path):
    clock = FakeClock()
    hooks = [
        jm.SummarySaverHook(save_steps=1, output_dir=tmp_path),
        jm.StepCounterHook(every_n_steps=1, output_dir=tmp_path, clock=clock),
    ]
    run_summaries(hooks, 6, clock=clock, dt=0.5)
    lines = read_jsonl(tmp_path / "metrics.jsonl")
    assert [line["step"] for line in lines] == [1, 2, 3, 4, 5, 6]
    assert all("wall_time" in line and isinstance(line["wall_time"], float) for line in lines)
    assert [line["loss"] for line in lines] == [2.0 * s for s in range(1, 7)]
    assert "global_step/sec" not in lines[0]  # the clock starts after the first run (which compiles)
    assert [line["global_step/sec"] for line in lines[1:]] == pytest.approx([2.0] * 5)
    assert len(event_files(tmp_path)) == 1


def nonfinite_step(state, batch):
    state = state + 1.0
    return state, {"nan": state * jnp.nan, "inf": state * jnp.inf, "ninf": -state * jnp.inf, "ok": state}


def test_non_finite_values_are_written_as_strings(tmp_path):
    hook = jm.SummarySaverHook(save_steps=1, output_dir=tmp_path)
    with jm.MonitoredSession(nonfinite_step, float_zero, hooks=[hook]) as sess:
        sess.run()
        sess.run()
    lines = read_jsonl(tmp_path / "metrics.jsonl")
    assert [(line["step"], line["nan"], line["inf"], line["ninf"], line["ok"]) for line in lines] == [
        (1, "nan", "inf", "-inf", 1.0), (2, "nan", "inf", "-inf", 2.0)]
    acc = read_events(tmp_path)
    assert math.isnan(acc.Scalars("nan")[0].value) and acc.Scalars("inf")[0].value == math.inf


def test_the_hyper_parameters_are_a_new_files_first_line_and_hparams_json_beside_it(tmp_path):
    path = tmp_path / "metrics.jsonl"
    writer = jm.JsonlWriter(path, clock=lambda: 12.5)
    writer.write_scalars(1, {"loss": np.float32(0.5)})  # pending: the hparams line still comes first
    writer.write_hparams({"model": {"width": 64}, "lr": np.float32(0.25)})
    writer.close()
    assert read_jsonl(path) == [{"hparams": {"model.width": 64, "lr": 0.25}},
                                {"step": 1, "wall_time": 12.5, "loss": 0.5}]
    assert json.loads((tmp_path / "hparams.json").read_text()) == {"model.width": 64, "lr": 0.25}

    again = jm.JsonlWriter(path, clock=lambda: 13.0)  # a resumed run: the file goes on, no second hparams line
    again.write_hparams({"lr": 0.5})
    again.write_scalars(2, {"loss": 0.25})
    again.close()
    assert [(sorted(line), line.get("step")) for line in read_jsonl(path)] == [
        (["hparams"], None), (["loss", "step", "wall_time"], 1), (["loss", "step", "wall_time"], 2)]
    assert json.loads((tmp_path / "hparams.json").read_text()) == {"lr": 0.5}


def test_texts_share_the_steps_line_and_each_step_has_one_line_in_order(tmp_path):
    path = tmp_path / "metrics.jsonl"
    writer = jm.JsonlWriter(path, clock=lambda: 1.0)
    writer.write_scalars(1, {"loss": 2})
    writer.write_texts(1, {"sample": 42})
    writer.write_scalars(2, {"loss": 1})
    writer.write_histograms(2, {"w": np.ones(3)})  # left to TensorBoard
    writer.write_images(2, {"picture": np.ones((2, 2))})
    writer.close()
    writer.close()  # a second close does nothing
    assert read_jsonl(path) == [{"step": 1, "wall_time": 1.0, "loss": 2, "sample": "42"},
                                {"step": 2, "wall_time": 1.0, "loss": 1}]


def test_a_write_error_names_the_file_and_the_fix():
    full = _write_error(OSError(errno.ENOSPC, "No space left on device"), "/runs/a/metrics.jsonl")
    assert full.errno == errno.ENOSPC
    assert str(full) == ("[Errno 28] No space left on device, writing /runs/a/metrics.jsonl: free space there "
                         "(or write the run elsewhere) and run again")
    broken = _write_error(OSError(errno.EIO, "Input/output error"), "/runs/a/metrics.jsonl")
    assert "check that disk" in str(broken)
    nameless = OSError("no errno")
    assert _write_error(nameless, "/x") is nameless


def test_copies_a_dead_process_left_beside_the_file_are_removed_and_a_live_ones_kept(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    path = tmp_path / "metrics.jsonl"
    for pid in (dead.pid, os.getpid(), 1):  # pid 1 lives (another user's, to this process)
        (tmp_path / f"metrics.jsonl.{pid}.tmp").write_text("{}\n")
    (tmp_path / "metrics.jsonl.notapid.tmp").write_text("")
    jm.JsonlWriter(path).close()
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "metrics.jsonl", "metrics.jsonl.1.tmp", "metrics.jsonl.notapid.tmp"]
