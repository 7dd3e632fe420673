"""Preemption with two real JAX processes: SIGTERM to one, and both save the same step."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
import warm_processes
from helpers import cpu_env, free_port

import jaxmon as jm

pytestmark = pytest.mark.processes  # every test here runs two JAX processes

WORKER = textwrap.dedent('''
    import sys, time
    import jax
    jax.config.update("jax_enable_preemption_service", True)
    process_id, address, directory = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    jax.distributed.initialize(address, num_processes=2, process_id=process_id, initialization_timeout=60)
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec
    import jaxmon as jm

    sharding = NamedSharding(Mesh(np.array(jax.devices()), ("x",)), PartitionSpec())

    def init_fn():  # one state replicated over both processes' devices
        return jax.make_array_from_callback((3,), sharding, lambda index: np.zeros((3,), np.float32)[index])

    def step_fn(state, batch):
        return state + 1, {"loss": state.sum()}

    hook = jm.CheckpointSaverHook(directory, save_steps=10**6)  # no periodic saves
    with jm.MonitoredSession(step_fn, init_fn, hooks=[hook, jm.StopAtStepHook(last_step=10**6)]) as sess:
        while not sess.should_stop():
            sess.run()
            print(f"step {sess.step}", flush=True)
            time.sleep(0.01)
    print(f"done {sess.step} {sess.preemption_requested} {hook.saved_steps}", flush=True)
''')


def test_sigterm_to_one_process_stops_both_at_one_saved_step(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    address, directory = f"127.0.0.1:{free_port()}", str(tmp_path / "ckpt")
    workers = [warm_processes.popen([sys.executable, str(script), str(i), address, directory], env=cpu_env(),
                                    stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True) for i in range(2)]
    try:
        deadline = time.monotonic() + 120
        line = ""
        while not line.startswith("step 20"):  # both are training (they step in lockstep)
            assert time.monotonic() < deadline and workers[1].poll() is None, "worker 1 did not start training"
            line = workers[1].stdout.readline()
        workers[1].send_signal(signal.SIGTERM)
        outputs = [worker.communicate(timeout=60)[0] for worker in workers]
    finally:
        for worker in workers:
            worker.kill()
    assert [worker.returncode for worker in workers] == [0, 0]
    done = [out.strip().splitlines()[-1].split(" ", 3) for out in outputs]
    steps = {int(d[1]) for d in done}
    assert len(steps) == 1, done  # both stopped at the step they agreed on
    (step,) = steps
    assert step > 20 and all(d[2] == "True" and d[3] == f"[0, {step}]" for d in done), done
    assert jm.latest_checkpoint_step(directory) == step
    restored = jm.restore_checkpoint(directory, like=np.zeros((3,), np.float32))  # onto this process's device
    assert restored.meta["step"] == step and np.array_equal(restored.state, np.full((3,), step, np.float32))
