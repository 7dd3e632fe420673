"""The watchdog: a process whose loop stops making progress (a data iterator that never
returns, a hook that blocks) ends within `watchdog_secs` and a few seconds, with every
thread's stack and one line saying the last step and what the loop was doing, exit code
76; the same command then resumes from the newest complete checkpoint."""

import json
import os
import sys
import textwrap
import time

import jax.numpy as jnp
import pytest
import warm_processes
from helpers import DEFAULT, ROOT

import jaxmon as jm
from jaxmon._processes import watchdog as _watchdog

pytestmark = pytest.mark.processes

#: A run of 20 steps saving every 5, whose data blocks forever before step 13 on the first try.
DATA_SCRIPT = textwrap.dedent("""
    import os, sys, threading, time
    import jax.numpy as jnp
    import jaxmon as jm

    workdir, marker = sys.argv[1], sys.argv[2]

    def data():
        step = 0
        while True:
            if step == 12 and not os.path.exists(marker):
                with open(marker, "w") as f:
                    f.write(repr(time.time()))
                threading.Event().wait()  # never returns
            step += 1
            yield jnp.float32(1.0)

    def step_fn(state, batch):
        return state + batch, {"loss": state}

    with jm.MonitoredTrainingSession(step_fn, state=jnp.zeros(()), data=data(), checkpoint_dir=workdir,
                                     save_checkpoint_steps=5, save_summaries_steps=1, log_step_count_steps=None,
                                     hooks=[jm.StopAtStepHook(last_step=20)], watchdog_secs=2,
                                     watchdog_startup_secs=120) as sess:
        print("restored", sess.restored_step, flush=True)
        while not sess.should_stop():
            sess.run()
    print("done", sess.step, float(sess.state), flush=True)
""")


def _run(args, timeout=180):
    return warm_processes.run(args, cwd=ROOT, text=True, capture_output=True, timeout=timeout,
                              env={**os.environ, "PYTHONUNBUFFERED": "1"})


def _blocked_for(marker, ended):
    """Seconds from the moment the run blocked (written in `marker`) to `ended`."""
    with open(marker) as f:
        return ended - float(f.read())


def _assert_watchdog(result, *words):
    """Exit 76, every thread's stack in stderr, and the one last line with `words`."""
    assert result.returncode == _watchdog.WATCHDOG_EXIT_CODE, result.stderr[-3000:]
    assert "the stacks of every thread follow" in result.stderr
    assert "most recent call first" in result.stderr and "Thread 0x" in result.stderr  # faulthandler's dump
    last = result.stderr.strip().splitlines()[-1]
    assert "the watchdog ended the run: no step completed in" in last, last
    assert "Exit code 76: run the same command to resume" in last, last
    for word in words:
        assert word in last, (word, last)
    return last


def test_a_data_iterator_that_blocks_ends_the_run_and_the_rerun_resumes(tmp_path):
    script, marker = tmp_path / "train.py", tmp_path / "blocked"
    script.write_text(DATA_SCRIPT)
    args = [sys.executable, str(script), str(tmp_path / "run"), str(marker)]
    result = _run(args)
    ended = time.time()
    last = _assert_watchdog(result, "(watchdog_secs=2)", "the last step was 12",
                            "the loop was waiting for data (the next batch of the data iterator)")
    assert _blocked_for(marker, ended) < 2 + 5, last
    assert "restored None" in result.stdout and "done" not in result.stdout
    assert f'File "{script}", line' in result.stderr and " in data\n" in result.stderr  # the generator's frame
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert max(record["step"] for record in records if "loss" in record) == 11  # past checkpoint 10: all delivered

    rerun = _run(args)  # the marker exists: the data no longer blocks
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    restored = int(rerun.stdout.split("restored ")[1].split()[0])
    assert restored in (5, 10), rerun.stdout  # the newest checkpoint complete when the process ended
    assert rerun.stdout.strip().splitlines()[-1] == "done 20 20.0"  # each step adds 1: resumed, not restarted


HOOK_MODULE = textwrap.dedent("""
    import os, threading, time
    import jaxmon as jm

    class BlockAt(jm.Hook):
        \"\"\"Blocks forever in the `after_run` of `step`, the first time only (a marker file).\"\"\"

        def __init__(self, step, marker):
            self.step, self.marker = step, marker

        def after_run(self, run_context, run_values):
            if run_values.step == self.step and not os.path.exists(self.marker):
                with open(self.marker, "w") as f:
                    f.write(repr(time.time()))
                threading.Event().wait()
""")

CONFIG = textwrap.dedent("""
    import runpy

    def get_config():
        config = runpy.run_path({default!r})["get_config"]()
        config["steps"] = 40
        config["hooks"] = [{{"name": "blocking_hook:BlockAt", "step": 23, "marker": {marker!r}}}]
        config["session"].update(save_checkpoint_steps=10, save_summaries_steps=None, log_step_count_steps=None,
                                 watchdog_secs=3, watchdog_startup_secs=120)
        return config
""")


def test_jaxmon_train_with_a_hook_that_blocks_exits_76_and_the_same_command_resumes(tmp_path):
    marker = tmp_path / "blocked"
    (tmp_path / "blocking_hook.py").write_text(HOOK_MODULE)
    config = tmp_path / "config.py"
    config.write_text(CONFIG.format(default=DEFAULT, marker=str(marker)))
    args = [sys.executable, "-m", "jaxmon", "train", "--config", str(config), "--workdir", str(tmp_path / "run")]
    result = _run(args)
    ended = time.time()
    last = _assert_watchdog(result, "(watchdog_secs=3)", "the last step was 23",
                            "the loop was in a hook: after_run (blocking_hook.py, line ")
    assert last.startswith("jaxmon train: "), last
    assert _blocked_for(marker, ended) < 3 + 5, last
    assert "blocking_hook.py" in result.stderr  # the hook's frame in the stacks

    rerun = _run(args)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert "Resumed from step 20 " in rerun.stdout + rerun.stderr, rerun.stdout + rerun.stderr


@pytest.mark.parametrize("name, value", [("watchdog_secs", 0), ("watchdog_secs", -1.0),
                                         ("watchdog_startup_secs", "10")])
def test_a_bad_deadline_is_refused_naming_it(name, value):
    with pytest.raises(ValueError, match=f"{name} must be a number > 0; got {value!r}"):
        jm.MonitoredSession(lambda s, b: (s, {}), state=jnp.zeros(()), **{name: value})


def test_the_watchdog_reads_what_the_loop_is_doing_from_its_stack():
    class Waiting(jm.Hook):
        def after_run(self, run_context, run_values):
            self.doing = watchdog.doing()

    watchdog = _watchdog.Watchdog(lambda: (0, False, None), secs=1000, startup_secs=1000)
    try:
        assert watchdog.doing() == "outside the session (in the code between two runs)"
        hook = Waiting()
        with jm.MonitoredSession(lambda s, b: (s + b, {}), state=jnp.zeros(()), data=[1.0, 2.0],
                                 hooks=[hook]) as sess:
            sess.run()
        assert hook.doing.startswith("in a hook: after_run (test_watchdog.py, line ")
    finally:
        watchdog.stop()


def test_a_session_that_steps_in_time_is_left_alone():
    ticks = []

    def step_fn(state, batch):
        return state + batch, {}

    # 0.1 s a step, 1.2 s in all: twice the deadline, each step well within it even when the
    # machine's load holds a step up (the watchdog would end this test's process).
    with jm.MonitoredSession(step_fn, state=jnp.zeros(()), data=[1.0] * 12, watchdog_secs=0.6,
                             watchdog_startup_secs=60) as sess:
        while not sess.should_stop():
            sess.run()
            time.sleep(0.1)
            ticks.append(sess.step)
    assert ticks == list(range(1, 13))
    sess._watchdog._thread.join(timeout=5)
    assert not sess._watchdog._thread.is_alive()  # stopped at close


def test_a_session_whose_close_raises_still_stops_its_watchdog(tmp_path):
    script = tmp_path / "close_raises.py"
    script.write_text(textwrap.dedent("""
        import time
        import jax.numpy as jnp
        import jaxmon as jm

        class BadClose(jm.Hook):
            def close(self):
                raise OSError("the writer's disk is gone")

        try:
            with jm.MonitoredSession(lambda s, b: (s + b, {}), state=jnp.zeros(()), data=[1.0, 2.0],
                                     hooks=[BadClose()], watchdog_secs=0.3, watchdog_startup_secs=1.5) as sess:
                sess.run()  # its compile (start-up) within 1.5 s, even on a loaded machine
        except OSError as error:
            print("caught", error, flush=True)
        time.sleep(3.0)  # the caller carries on: no watchdog may end it now (closing: 1.5 s)
        print("alive", flush=True)
    """))
    result = _run([sys.executable, str(script)])
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.splitlines() == ["caught the writer's disk is gone", "alive"]
