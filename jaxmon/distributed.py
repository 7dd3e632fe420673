"""Several JAX processes (one per host, or several on one machine) running one training.

jaxmon runs on JAX's own multi-controller runtime: every process runs the same
program, `jax.distributed` connects them, and a session with several processes agrees
on every decision that ends or changes the loop (see `MonitoredSession`).

Example (two processes on one machine; run the script twice, with `JAX_PROCESS_ID=0`
and `=1`)::

    import jaxmon as jm
    jm.distributed.initialize("127.0.0.1:12345", num_processes=2)   # or from the environment
    mesh = jax.make_mesh((jax.device_count(),), ("data",),         # every process's devices
                         axis_types=(jax.sharding.AxisType.Auto,))
    with jm.MonitoredTrainingSession(step_fn, init_fn, data=local_batches, mesh=mesh,
                                     checkpoint_dir="runs/dp") as sess:
        while not sess.should_stop():
            sess.run()
"""

from __future__ import annotations

import logging
import os

import jax

__all__ = ["initialize", "is_chief", "shutdown"]

logger = logging.getLogger("jaxmon")


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, *, initialization_timeout: int = 300,
               preemption_sync: bool = True, log_prefix: bool = True, **kwargs) -> None:
    """`jax.distributed.initialize` with what a jaxmon session expects.

    Args:
      coordinator_address: `host:port` of process 0; default `$JAX_COORDINATOR_ADDRESS`
        (or what JAX detects on SLURM, Kubernetes, TPU pods, ...).
      num_processes: default `$JAX_NUM_PROCESSES`.
      process_id: this process's index; default `$JAX_PROCESS_ID`.
      initialization_timeout: seconds to wait for every process to connect.
      preemption_sync: turn on JAX's preemption service, so that SIGTERM on any process
        makes every process save and stop at one agreed step.
      log_prefix: prefix the `jaxmon` logger's lines with `[process i/n]`.
      **kwargs: passed on to `jax.distributed.initialize` (e.g. `local_device_ids`, or
        `heartbeat_timeout_seconds`: when a process dies, the others raise
        `jm.PeerError` at their next run at once, but JAX aborts them only after this
        timeout, 100 s by default).
    """
    coordinator_address = coordinator_address or os.environ.get("JAX_COORDINATOR_ADDRESS")
    if num_processes is None and os.environ.get("JAX_NUM_PROCESSES"):
        num_processes = int(os.environ["JAX_NUM_PROCESSES"])
    if process_id is None and os.environ.get("JAX_PROCESS_ID"):
        process_id = int(os.environ["JAX_PROCESS_ID"])
    if preemption_sync:
        jax.config.update("jax_enable_preemption_service", True)
    jax.distributed.initialize(coordinator_address, num_processes=num_processes, process_id=process_id,
                               initialization_timeout=initialization_timeout, **kwargs)
    if log_prefix:
        prefix = f"[process {jax.process_index()}/{jax.process_count()}] "

        def add_prefix(record: logging.LogRecord) -> bool:
            if not str(record.msg).startswith(prefix):
                record.msg = prefix + str(record.msg)
            return True

        logger.addFilter(add_prefix)
    logger.info("Process %d of %d, %d local of %d devices.", jax.process_index(), jax.process_count(),
                jax.local_device_count(), jax.device_count())


def is_chief() -> bool:
    """Whether this process is the chief (process 0): it writes summaries and runs
    `chief_only_hooks`."""
    return jax.process_index() == 0


def shutdown() -> None:
    """`jax.distributed.shutdown()`: disconnects from the other processes."""
    jax.distributed.shutdown()
