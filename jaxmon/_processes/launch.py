"""Whether `jaxmon train` is one of several JAX processes, and connecting them.

The same command runs on every host. A process is one of several when the
`JAX_COORDINATOR_ADDRESS`, `JAX_NUM_PROCESSES` and `JAX_PROCESS_ID` variables say so
(a Kubernetes indexed Job's `JOB_COMPLETION_INDEX` standing for the last), or when it
runs in a cluster that `jax.distributed.initialize()` detects by itself
(JAX's own detection: SLURM, Open MPI's `mpirun`, a Cloud TPU slice, a Kubernetes
Job), with more than one process; it then connects to the others before anything
touches a device. A single process (a laptop, one SLURM task, one TPU host) never
tries to connect.
"""

from __future__ import annotations

import logging
import warnings
from typing import Any, NamedTuple

import jax

from jaxmon import distributed
from jaxmon._base.errors import ConfigError
from jaxmon._processes import agree as _agree

__all__ = ["Cluster", "connect", "detect"]

logger = logging.getLogger("jaxmon")


#: What to call JAX's cluster environments (its `jax._src.clusters` classes) in messages.
_NAMES = {"SlurmCluster": "SLURM", "OmpiCluster": "Open MPI", "GceTpuCluster": "a Cloud TPU slice",
          "GkeTpuCluster": "a TPU slice on GKE", "K8sCluster": "a Kubernetes Job"}


class Cluster(NamedTuple):
    """How many JAX processes this one is one of (1: it runs alone), and what said so
    (`"JAX_NUM_PROCESSES"`, `"SLURM"`, ...; empty for a single process)."""

    processes: int
    source: str


def detect() -> Cluster:
    """How many processes this one is one of: `JAX_NUM_PROCESSES` if set, else what
    the cluster JAX detects reports (SLURM's `SLURM_NTASKS`, ...), else 1.

    Raises:
      ConfigError: the `JAX_*` variables are set but incomplete or not numbers.
    """
    given = distributed.variables()
    if "JAX_NUM_PROCESSES" not in given:
        env = _cluster_env()
        if env is not None:
            return Cluster(_process_count(env), _NAMES.get(env.__name__, env.__name__))
        if given:
            raise ConfigError(f"{' and '.join(given)} set, but not JAX_NUM_PROCESSES: set JAX_COORDINATOR_ADDRESS "
                              "(host:port of process 0), JAX_NUM_PROCESSES and JAX_PROCESS_ID on every process, "
                              "or unset them to train in one process.")
        return Cluster(1, "")
    count = _whole(given, "JAX_NUM_PROCESSES", minimum=1)
    missing = [name for name in ("JAX_COORDINATOR_ADDRESS", "JAX_PROCESS_ID") if name not in given]
    if count > 1 and missing and _cluster_env() is None:  # a cluster fills in what is missing
        raise ConfigError(f"JAX_NUM_PROCESSES={count} but {' and '.join(missing)} not set: give every process "
                          "JAX_COORDINATOR_ADDRESS (host:port of process 0) and its JAX_PROCESS_ID "
                          f"(0 to {count - 1}).")
    if count > 1 and "JAX_PROCESS_ID" in given and _whole(given, "JAX_PROCESS_ID", minimum=0) >= count:
        raise ConfigError(f"JAX_PROCESS_ID={given['JAX_PROCESS_ID']} with JAX_NUM_PROCESSES={count}: give each "
                          f"process an id from 0 to {count - 1}.")
    return Cluster(count, "JAX_NUM_PROCESSES")


def connect() -> Cluster:
    """Connects to the other processes (`jaxmon.distributed.initialize()`, JAX's own
    detection) if this process is one of several and not connected yet; returns
    `detect()`'s answer. The lines a lost peer (when JAX's coordination client ends the
    process) or the watchdog end this process with start with `jaxmon train: `, as the
    command's own do."""
    _agree.failure_line["prefix"] = "jaxmon train: "
    cluster = detect()
    if cluster.processes > 1 and not jax.distributed.is_initialized():
        logger.info("One of %d processes (%s): connecting to the others.", cluster.processes, cluster.source)
        distributed.initialize()
    return cluster


def _cluster_env() -> Any:
    """The cluster environment `jax.distributed.initialize()` would detect: the first of
    JAX's `ClusterEnv` subclasses, in its order, that finds itself present (opt-in ones
    such as mpi4py left out, as JAX leaves them); None if none does."""
    try:
        from jax._src.clusters import ClusterEnv
    except ImportError as error:  # JAX moved them: only the JAX_* variables count
        logger.debug("No cluster detection (JAX's clusters not found: %s).", error)
        return None
    with warnings.catch_warnings(record=True) as caught:  # Kubernetes without its package, say: no noise
        warnings.simplefilter("always")
        env = next((env for env in _subclasses(ClusterEnv) if not env.opt_in_only_method and env.is_env_present()),
                   None)
    for warning in caught:
        logger.info("Cluster detection: %s", " ".join(str(warning.message).split()))
    return env


def _subclasses(cls: type) -> list[type]:
    """Every subclass of `cls`, in the order they were defined (as JAX registers them)."""
    return [kind for sub in cls.__subclasses__() for kind in (sub, *_subclasses(sub))]


def _process_count(env: Any) -> int:
    """The number of processes `env` (a `ClusterEnv` subclass) reports; 1, with a
    warning, if it cannot tell (a Kubernetes pod outside a Job, say)."""
    try:
        return int(env.get_process_count())
    except Exception as error:
        logger.warning("%s detected, but not its number of processes (%s: %s): training in this process alone.",
                       _NAMES.get(env.__name__, env.__name__), type(error).__name__, error)
        return 1


def _whole(given: dict[str, str], name: str, *, minimum: int) -> int:
    """The whole number the variable `name` holds; a ConfigError naming it if not one >= `minimum`."""
    try:
        value = int(given[name])
    except ValueError:
        value = None
    if value is None or value < minimum:
        raise ConfigError(f"{name}={given[name]!r}: give a whole number >= {minimum}.")
    return value
