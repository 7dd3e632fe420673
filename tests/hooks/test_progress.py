"""ProgressBarHook: what it draws (step, rate, ETA, loss, the session's perf figures), and
where it stays quiet, run in real sessions with a fake clock."""

import io
import itertools
import json

import jax.numpy as jnp
import numpy as np
import pytest
from helpers import FakeClock, all_warnings, count_step, float_loss_step, zero

import jaxmon as jm


class FakeTTY(io.StringIO):
    def isatty(self):
        return True


def run_until_stop(sess, clock, dt=1.0):
    while not sess.should_stop():
        sess.run()
        clock.t += dt


def test_progress_bar_draws_step_rate_eta_and_loss(logs):
    clock, stream = FakeClock(), io.StringIO()
    bar = jm.ProgressBarHook(stream=stream, enabled=True, clock=clock)
    sess = jm.MonitoredSession(float_loss_step, zero, hooks=[jm.StopAtStepHook(last_step=5), bar])
    run_until_stop(sess, clock)
    assert sess.step == 5
    sess.close()
    text = stream.getvalue()
    frames = [frame for frame in text.split("\r") if frame]
    assert any("step 5/5" in frame for frame in frames)  # total_steps from the StopAtStepHook
    assert "steps/s" in text and "ETA" in text and "loss" in text
    # refreshed every 0.2 s from the session's start: first after run 2, with the mean of steps 1-2
    assert "step 2/5" in frames[0] and "loss 0.75" in frames[0]  # (1 + 1 / 2) / 2
    assert not any("step 1/5" in frame for frame in frames)
    assert text.endswith("\n")
    assert all_warnings(logs) == []


def test_progress_bar_total_steps_argument_wins():
    clock, stream = FakeClock(), io.StringIO()
    bar = jm.ProgressBarHook(total_steps=10, stream=stream, enabled=True, clock=clock)
    sess = jm.MonitoredSession(float_loss_step, zero, hooks=[jm.StopAtStepHook(last_step=5), bar])
    run_until_stop(sess, clock)
    sess.close()
    assert "step 5/10" in stream.getvalue() and "/5" not in stream.getvalue()


@pytest.mark.parametrize("ci, stream_type", [(None, io.StringIO), ("true", FakeTTY)],
                         ids=["not-a-terminal", "ci-on-a-terminal"])
def test_progress_bar_quiet_off_a_terminal_or_on_ci(monkeypatch, ci, stream_type):
    if ci is None:
        monkeypatch.delenv("CI", raising=False)
    else:
        monkeypatch.setenv("CI", ci)
    clock, stream = FakeClock(), stream_type()
    bar = jm.ProgressBarHook(stream=stream, clock=clock)
    sess = jm.MonitoredSession(float_loss_step, zero, hooks=[jm.StopAtStepHook(last_step=3), bar])
    run_until_stop(sess, clock)
    sess.close()
    assert sess.step == 3 and stream.getvalue() == ""


def test_progress_bar_draws_on_a_terminal_outside_ci(monkeypatch):
    monkeypatch.delenv("CI", raising=False)
    clock, stream = FakeClock(), FakeTTY()
    bar = jm.ProgressBarHook(stream=stream, clock=clock)
    sess = jm.MonitoredSession(float_loss_step, zero, hooks=[jm.StopAtStepHook(last_step=3), bar])
    run_until_stop(sess, clock)
    sess.close()
    text = stream.getvalue()
    assert "step 3/3" in text and "loss" in text and text.endswith("\n")


def test_progress_bar_skips_a_missing_loss(logs):
    clock, stream = FakeClock(), io.StringIO()
    bar = jm.ProgressBarHook(stream=stream, enabled=True, clock=clock)
    sess = jm.MonitoredSession(count_step, zero, hooks=[jm.StopAtStepHook(last_step=3), bar])
    run_until_stop(sess, clock)
    sess.close()
    text = stream.getvalue()
    assert "step 3/3" in text and "steps/s" in text
    assert "loss" not in text
    assert all_warnings(logs) == []


def test_progress_bar_is_drawn_by_rich_in_colour_on_a_terminal_and_plain_elsewhere(monkeypatch):
    monkeypatch.delenv("CI", raising=False)
    for stream, coloured in ((FakeTTY(), True), (io.StringIO(), False)):
        clock = FakeClock()
        bar = jm.ProgressBarHook(stream=stream, enabled=True, clock=clock)
        sess = jm.MonitoredSession(float_loss_step, zero, hooks=[jm.StopAtStepHook(last_step=4), bar])
        run_until_stop(sess, clock)
        sess.close()
        last = [frame for frame in stream.getvalue().split("\r") if frame][-1]
        assert "━" in last and "100.0%  step 4/4" in last  # rich's bar, then the same words as before
        assert ("\x1b[" in last.replace("\x1b[K", "")) is coloured


def regression_step(state, batch):
    return state - 0.01 * batch["x"].T @ (batch["x"] @ state), {"loss": jnp.mean((batch["x"] @ state) ** 2)}


@pytest.mark.parametrize("known", ["examples", "tokens and peak"])
def test_progress_bar_shows_the_training_sessions_perf_figures(tmp_path, known):
    from jaxmon.hooks._throughput import Throughput

    clock, stream = FakeClock(), io.StringIO()
    bar = jm.ProgressBarHook(stream=stream, enabled=True, clock=clock)
    perf = [Throughput(regression_step, tokens_per_step=32 * 128, peak_tflops=1e-3, every_n_steps=5)]
    batch = {"x": np.ones((32, 16), np.float32)}
    sess = jm.MonitoredTrainingSession(regression_step, state=jnp.zeros((16, 1)), data=itertools.repeat(batch),
                                       checkpoint_dir=tmp_path, save_summaries_steps=5,
                                       chief_only_hooks=perf if known != "examples" else None,
                                       hooks=[jm.StopAtStepHook(last_step=20), bar])
    run_until_stop(sess, clock)
    sess.close()
    last = [frame for frame in stream.getvalue().split("\r") if frame][-1]
    if known == "examples":  # the session's own service: examples from the batch's rows, no peak on a CPU
        with open(tmp_path / "metrics.jsonl") as lines:
            figures = [row for row in map(json.loads, lines) if "perf/examples_per_sec" in row][-1]
        assert figures["step"] == 20
        assert f"{figures['perf/examples_per_sec']:.4g} examples/s" in last
        assert "tokens/s" not in last and "MFU" not in last
        from jaxmon._cli.runs import run_info  # `jaxmon inspect` shows the same figure

        assert run_info(str(tmp_path))["metrics"]["perf/examples_per_sec"] == (20, figures["perf/examples_per_sec"])
    else:
        figures = perf[0].figures
        assert figures["perf/tokens_per_sec"] == pytest.approx(32 * 128 * figures["perf/steps_per_sec"])
        assert f"{figures['perf/tokens_per_sec']:.4g} tokens/s" in last and "examples/s" not in last
        assert f"MFU {figures['perf/mfu']:.1%}" in last
    assert f"{figures['perf/tflops_per_sec_per_device']:.3g} TFLOP/s" in last
