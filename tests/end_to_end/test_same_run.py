"""A resumed run is the same run: a training process SIGKILLed after checkpoint N and
resumed leaves the metrics.jsonl, TensorBoard scalars and text and evaluations of a run
that was never interrupted, each point once, the config's record too (read back from
the real files)."""

import json
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import warm_processes
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import jaxmon as jm

SCRIPT = textwrap.dedent("""
    import sys, time
    import jax.numpy as jnp
    import numpy as np
    import jaxmon as jm

    directory, last_step, slow_after = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])

    def step_fn(state, batch):
        state = state + 1.0
        tokens = 1.0 + state % 3
        return state, {"loss": 1.0 / state, "loss_sum": state * tokens, "tokens": tokens}

    def eval_fn(state, batch):
        return {"loss": (batch["x"] - state).mean() ** 2}

    class Pace(jm.Hook):  # room to be killed between two checkpoints
        def after_run(self, ctx, values):
            print("step", values.step, flush=True)
            if values.step > slow_after:
                time.sleep(0.3)

    summaries = jm.SummarySaverHook(save_steps=4, output_dir=directory, output_scalars=False, summaries={
        "ratio": jm.Ratio("loss_sum", "tokens"),
        "ppl": jm.Ratio("loss_sum", "tokens").then(np.exp),
        "note": jm.Text(lambda state, batch, outputs: state, format=lambda v: f"state {float(v):.0f}")})
    evaluate = jm.EvalHook(eval_fn, [{"x": np.arange(4.0)}], every_n_steps=6, output_dir=directory, at_end=False)
    hooks = [jm.StopAtStepHook(last_step=last_step), summaries, evaluate, Pace()]
    with jm.MonitoredTrainingSession(step_fn, lambda: jnp.zeros(()), checkpoint_dir=directory,
                                     data=jm.ArrayDataSource({"i": np.arange(64)}, 1, seed=0),
                                     save_checkpoint_steps=10, save_summaries_steps=5, log_step_count_steps=None,
                                     save_checkpoint_secs=None, hooks=hooks, config={"last_step": last_step}) as sess:
        while not sess.should_stop():
            sess.run()
    print("evaluated", [step for step, _ in evaluate.history], flush=True)
""")

LAST_STEP = 40


def train(script, directory, slow_after=10**6, last_step=LAST_STEP):
    result = warm_processes.run([sys.executable, str(script), str(directory), str(last_step), str(slow_after)],
                                capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def kill_after_checkpoint(script, directory, checkpoint, step):
    """Starts a run to LAST_STEP and SIGKILLs it at `step`, once `checkpoint` is complete."""
    process = warm_processes.popen([sys.executable, str(script), str(directory), str(LAST_STEP), str(checkpoint)],
                                   stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        deadline = time.monotonic() + 180
        for line in process.stdout:
            assert time.monotonic() < deadline, f"the run did not reach step {step}"
            if line.startswith("step ") and int(line.split()[1]) >= step \
                    and jm.latest_checkpoint_step(directory) == checkpoint:
                break
        else:
            pytest.fail("the run ended before it could be killed")
        process.send_signal(signal.SIGKILL)
    finally:
        process.wait(timeout=60)
        process.stdout.close()


def jsonl(directory):
    """Every (step, tag) -> value of metrics.jsonl; a point written twice fails."""
    points = {}
    for line in (directory / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if "step" not in record:
            continue
        for tag, value in record.items():
            if tag not in ("step", "wall_time"):
                assert (record["step"], tag) not in points, f"{tag} at step {record['step']} twice"
                points[record["step"], tag] = value
    return points


def tensorboard(directory):
    """Every scalar and text point TensorBoard shows, as (tag, step) -> value."""
    acc = EventAccumulator(str(directory), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    points = {}
    for tag in acc.Tags()["scalars"]:
        for event in acc.Scalars(tag):
            assert (tag, event.step) not in points, f"{tag} at step {event.step} twice"
            points[tag, event.step] = event.value
    for tag in acc.Tags()["tensors"]:
        for event in acc.Tensors(tag):
            assert (tag, event.step) not in points, f"{tag} at step {event.step} twice"
            points[tag, event.step] = event.tensor_proto.string_val[0].decode()
    return points


def assert_same(points, expected):
    """The same points with the same values: numbers to float32 tolerance, text exactly
    (the goodput's seconds and the throughput only at the same points)."""
    assert sorted(points, key=str) == sorted(expected, key=str)
    for key, value in expected.items():
        if "goodput/" in str(key) or "perf/" in str(key):  # timed: at the same steps, never the same values
            continue
        assert points[key] == (value if isinstance(value, str) else pytest.approx(value, rel=1e-6)), key


@pytest.fixture(scope="module")
def uninterrupted_run(tmp_path_factory):
    """The run never interrupted: (its directory, its output)."""
    directory = tmp_path_factory.mktemp("whole")
    script = directory / "train.py"
    script.write_text(SCRIPT)
    return directory / "run", train(script, directory / "run")


@pytest.mark.parametrize("checkpoint, step", [(20, 23), (30, 30)])
def test_a_run_killed_after_checkpoint_n_and_resumed_is_the_uninterrupted_run(tmp_path, uninterrupted_run, checkpoint,
                                                                              step):
    whole, uninterrupted = uninterrupted_run
    script, cut = tmp_path / "train.py", tmp_path / "cut"
    script.write_text(SCRIPT)
    kill_after_checkpoint(script, cut, checkpoint, step)
    assert jm.latest_checkpoint_step(cut) == checkpoint
    resumed = train(script, cut)

    expected = jsonl(whole)
    assert_same(jsonl(cut), expected)
    assert sorted({s for s, tag in expected if tag == "ratio"}) == [1, 4, 8, 12, 16, 20, 24, 28, 32, 36, 40]
    assert sorted({s for s, tag in expected if tag == "eval/loss"}) == [6, 12, 18, 24, 30, 36]
    expected = tensorboard(whole)
    assert_same(tensorboard(cut), expected)
    assert expected["note/text_summary", 24] == "state 24"
    assert uninterrupted.splitlines()[-1] == resumed.splitlines()[-1] == "evaluated [6, 12, 18, 24, 30, 36]"


def test_a_run_killed_and_resumed_three_times_writes_its_config_once_and_again_when_it_changes(tmp_path):
    script, cut = tmp_path / "train.py", tmp_path / "cut"
    script.write_text(SCRIPT)
    for checkpoint in (10, 20, 30):
        kill_after_checkpoint(script, cut, checkpoint, checkpoint + 2)
        assert jm.latest_checkpoint_step(cut) == checkpoint
    train(script, cut)
    assert [step for step, tag in jsonl(cut) if tag == "config"] == [0]
    assert [step for tag, step in tensorboard(cut) if tag == "config/text_summary"] == [0]
    assert json.loads(jsonl(cut)[0, "config"]) == {"last_step": LAST_STEP}
    train(script, cut, last_step=LAST_STEP + 4)  # a resume with another config: news, written at its step
    assert [step for step, tag in jsonl(cut) if tag == "config"] == [0, LAST_STEP]
    assert json.loads(tensorboard(cut)["config/text_summary", LAST_STEP]) == {"last_step": LAST_STEP + 4}
