"""A run killed after a checkpoint and resumed writes each step's summaries once: TF's
`SessionLog.START` at the restored step makes TensorBoard drop the orphaned points, and
metrics.jsonl loses the lines written after the checkpoint."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import warm_processes
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import jaxmon as jm
from jaxmon._cli.main import records

SCRIPT = textwrap.dedent("""
    import sys, time
    import jax.numpy as jnp
    import jaxmon as jm

    directory, last_step = sys.argv[1], int(sys.argv[2])

    def step_fn(state, batch):
        state = state + 1.0
        return state, {"loss": state}

    class Flush(jm.Hook):  # what a long run's full buffers do on their own: reach the disk
        def begin(self):
            self.writer = jm.SummaryWriterCache.get(directory)

        def after_run(self, ctx, values):
            self.writer.flush()
            print("step", values.step, flush=True)
            if values.step > 12:
                time.sleep(0.5)  # time to be killed with checkpoint 10 on disk

        def close(self):
            self.writer.close()

    with jm.MonitoredTrainingSession(step_fn, lambda: jnp.zeros(()), checkpoint_dir=directory, data=iter(dict, 1),
                                     save_checkpoint_steps=10, save_summaries_steps=1, log_step_count_steps=None,
                                     hooks=[jm.StopAtStepHook(last_step=last_step), Flush()]) as sess:
        while not sess.should_stop():
            sess.run()
""")


def test_kill_after_checkpoint_10_and_resume_to_20_writes_each_step_once(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    directory = tmp_path / "run"
    killed = warm_processes.popen([sys.executable, str(script), str(directory), "1000"], stdout=subprocess.PIPE,
                                  text=True)
    try:
        deadline = time.monotonic() + 120
        for line in killed.stdout:
            assert time.monotonic() < deadline, "the run did not reach step 14"
            if line.strip() == "step 14" and jm.latest_checkpoint_step(directory) == 10:
                break
        killed.send_signal(signal.SIGKILL)
        assert killed.wait(30) == -signal.SIGKILL
    finally:
        killed.kill()
        killed.wait(30)
    steps = [record["step"] for record in records(os.fspath(directory / "metrics.jsonl"))]
    assert steps[:14] == list(range(1, 15)) if len(steps) >= 14 else steps == list(range(1, len(steps) + 1))
    assert max(steps) > 10  # the killed run wrote past its last checkpoint

    resumed = warm_processes.run([sys.executable, str(script), str(directory), "20"], capture_output=True, text=True,
                                 timeout=120)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert resumed.stdout.split()[1::2][0] == "11"  # it went on from checkpoint 10

    events = EventAccumulator(os.fspath(directory))
    events.Reload()
    assert [event.step for event in events.Scalars("loss")] == list(range(1, 21))
    assert [event.value for event in events.Scalars("loss")] == [float(step) for step in range(1, 21)]
    written = records(os.fspath(directory / "metrics.jsonl"))
    assert [record["step"] for record in written] == list(range(1, 21))
    assert [record["loss"] for record in written] == [float(step) for step in range(1, 21)]
