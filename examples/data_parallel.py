"""Data-parallel training on every device of every process: an MLP on the UCI digits.

Each process reads its own slice of the training set and feeds its part of every
global batch; the state is replicated on a mesh over all devices; the chief (process
0) writes summaries; every process writes its part of each checkpoint.

Run it
  - in one process on 8 simulated CPU devices:
      XLA_FLAGS=--xla_force_host_platform_device_count=8 python examples/data_parallel.py
  - as 2 processes on this machine (the script starts them and waits):
      python examples/data_parallel.py --launch 2
  - on several hosts: start it once per host with
      JAX_COORDINATOR_ADDRESS=host0:12345 JAX_NUM_PROCESSES=<hosts> JAX_PROCESS_ID=<i> \\
          python examples/data_parallel.py --workdir /shared/runs/dp
Run it again with the same --workdir and it resumes from the last checkpoint. If a
process dies, the others stop too, each with one line and exit code 75 (`jm.PeerError`).
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import AxisType

import jaxmon as jm


def launch(processes: int, argv: list[str]) -> int:
    """Starts `processes` copies of this script on this machine, one JAX process each."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}", "JAX_NUM_PROCESSES": str(processes),
           "JAX_PLATFORMS": "cpu"}
    workers = [subprocess.Popen([sys.executable, __file__, *argv], env={**env, "JAX_PROCESS_ID": str(i)})
               for i in range(processes)]
    try:
        codes = [worker.wait(timeout=600) for worker in workers]
    finally:
        for worker in workers:
            worker.kill()
    return max(codes, key=abs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--launch", type=int, metavar="N", help="start N processes on this machine")
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--global-batch", type=int, default=128)
    parser.add_argument("--workdir", default=None, help="checkpoints and summaries (default: a new temp dir)")
    args, rest = parser.parse_known_args()
    if args.launch:
        workdir = args.workdir or tempfile.mkdtemp(prefix="data_parallel-")
        argv = [a for a in sys.argv[1:] if not a.startswith("--launch") and a != str(args.launch)]
        sys.exit(launch(args.launch, [*argv, "--workdir", workdir]))
    if os.environ.get("JAX_NUM_PROCESSES"):
        jm.distributed.initialize()  # from JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID
    workdir = args.workdir or tempfile.mkdtemp(prefix="data_parallel-")
    rank, processes = jax.process_index(), jax.process_count()
    if args.global_batch % jax.device_count():
        parser.error(f"--global-batch {args.global_batch} must split evenly over {jax.device_count()} devices.")

    train, test = jm.datasets.digits("train"), jm.datasets.digits("test")
    mine = {k: v[rank::processes] for k, v in train.items()}  # this process's slice of the data
    data = jm.ArrayDataSource(mine, batch_size=args.global_batch // processes, seed=rank)
    model = jm.models.MLP(features=(128,), num_outputs=10)
    tx = optax.adam(2e-3)

    def init_fn() -> jm.TrainState:  # the same seed on every process: one replicated state
        params = model.init(jax.random.PRNGKey(0), jnp.zeros((1, 8, 8, 1)))["params"]
        return jm.TrainState.create(apply_fn=model.apply, params=params, tx=tx)

    def step_fn(state, batch):
        def loss_fn(params):
            logits = state.apply_fn({"params": params}, batch["x"])
            loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
            return loss, jnp.mean(jnp.argmax(logits, -1) == batch["y"])

        (loss, accuracy), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
        return state.apply_gradients(grads=grads), {"loss": loss, "accuracy": accuracy}

    # Auto axes: XLA chooses the sharding of every value the step computes, as it did before
    # JAX 0.10 made Explicit axes jax.make_mesh's default (their stricter rules refuse, on JAX
    # 0.11, the gather in this step's cross-entropy). The batch is split over "data" either way.
    mesh = jax.make_mesh((jax.device_count(),), ("data",), axis_types=(AxisType.Auto,))
    with jm.MonitoredTrainingSession(step_fn, init_fn, data=data, mesh=mesh, checkpoint_dir=workdir,
                                     hooks=[jm.StopAtStepHook(last_step=args.steps), jm.NanHook("loss")],
                                     save_checkpoint_steps=200, save_summaries_steps=50,
                                     log_step_count_steps=200) as sess:
        while not sess.should_stop():
            sess.run()

    params = jax.tree.map(lambda a: np.asarray(a.addressable_data(0)), sess.state.params)  # replicated
    logits = model.apply({"params": params}, test["x"])
    accuracy = float(np.mean(np.argmax(logits, -1) == test["y"]))
    print(f"process {rank}/{processes}, {jax.device_count()} devices: step {sess.step}, "
          f"test accuracy {accuracy:.4f}  ({workdir})", flush=True)


if __name__ == "__main__":
    try:
        main()
    except jm.PeerError as error:  # another process died (or failed): this one stops too; run again to resume
        print(f"data_parallel.py: {type(error).__name__}: {error}", file=sys.stderr, flush=True)
        sys.exit(error.exit_code)  # 75 for a process that died: the checkpoints saved so far stand
