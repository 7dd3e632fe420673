"""Small shared pieces for the tests: a recording hook, tiny step and init functions,
endless data, what a mean over steps gives, and the environment of child JAX processes."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import jaxmon as jm


class RecordingHook(jm.Hook):
    """Logs every event as (name, event) into a shared list; fetches/feeds on request."""

    def __init__(self, name="hook", log=None, fetches=None, feeds=None, stop_at=None, raise_in=None):
        self.name = name
        self.log = [] if log is None else log
        self.fetches, self.feeds = fetches, feeds
        self.stop_at = stop_at  # request stop in after_run once values.step reaches this
        self.raise_in = raise_in or {}  # {event: (call_number, exception)}
        self.contexts, self.values, self.sessions = [], [], []
        self.calls = {}

    def _event(self, event):
        self.log.append((self.name, event))
        self.calls[event] = self.calls.get(event, 0) + 1
        if event in self.raise_in and self.calls[event] == self.raise_in[event][0]:
            raise self.raise_in[event][1]

    def begin(self):
        self._event("begin")

    def after_create_session(self, session):
        self.sessions.append(session)
        self._event("after_create_session")

    def before_run(self, ctx):
        self.contexts.append(ctx)
        self._event("before_run")
        if self.fetches is None and self.feeds is None:
            return None
        return jm.RunArgs(fetches=self.fetches, feeds=self.feeds)

    def after_run(self, ctx, values):
        self.values.append(values)
        self._event("after_run")
        if self.stop_at is not None and values.step >= self.stop_at:
            ctx.request_stop()

    def end(self, session):
        self._event("end")

    def __repr__(self):
        return f"RecordingHook({self.name!r})"


def count_step(state, batch):
    """Adds 1 to a scalar counter; outputs the new value."""
    state = state + 1
    return state, {"value": state}


def zero():
    """A scalar int32 state of 0."""
    return jnp.zeros((), jnp.int32)


def float_zero():
    """A scalar float32 state of 0."""
    return jnp.zeros((), jnp.float32)


def forever():
    """Endless empty batches: `data=` for a session that stops by a hook."""
    while True:
        yield {}


def window_means(values, steps, start=0):
    """What reduce="mean" gives at each of `steps`: the mean of `values[t]` (step t's output)
    over the steps after the previous one of `steps` (or after `start`) up to it."""
    windows = zip([start, *steps[:-1]], steps, strict=True)
    return [float(np.mean([values[t] for t in range(lo + 1, hi + 1)])) for lo, hi in windows]


def events(log, event):
    return [name for name, e in log if e == event]


class Counter:
    """An iterator over batches {"x": 1.}, {"x": 2.}, ... (`count` of them, default
    endless), whose position is how many it gave; `closed` once closed."""

    def __init__(self, count=float("inf")):
        self.i, self.count, self.closed = 0, count, False

    def __iter__(self):
        return self

    def __next__(self):
        if self.i >= self.count:
            raise StopIteration
        self.i += 1
        return {"x": np.float32(self.i)}

    def get_state(self):
        return {"i": self.i}

    def set_state(self, state):
        self.i = state["i"]

    def close(self):
        self.closed = True


class Plain:
    """The same batches without a position."""

    def __init__(self, count=float("inf")):
        self._batches = Counter(count)

    @property
    def i(self):
        return self._batches.i

    def __iter__(self):
        return self

    def __next__(self):
        return next(self._batches)


class RunCounter(jm.Hook):
    """Counts the runs it has seen; the count is its checkpointed state."""

    def __init__(self):
        self.count = 0

    def after_run(self, ctx, values):
        self.count += 1

    def get_state(self):
        return {"count": self.count}

    def set_state(self, state):
        self.count = state["count"]


def step_times(step, state, batch, times=3):
    """Seconds of each of `times` calls of the jitted `step(state, batch)`, each waited for
    (compiled first, untimed)."""
    jax.block_until_ready(step(state, batch))
    seconds = []
    for _ in range(times):
        start = time.perf_counter()
        jax.block_until_ready(step(state, batch))
        seconds.append(time.perf_counter() - start)
    return seconds


class FakeClock:
    """A clock for hooks' `clock=`: returns `t`, which tests move by hand."""

    def __init__(self, t=1000.0):
        self.t = t

    def __call__(self):
        return self.t


class RecordingWriter:
    """A SummaryWriter that keeps every call: `calls` in order, `scalars` as (step, dict)."""

    def __init__(self):
        self.calls, self.scalars, self.flushes, self.closes = [], [], 0, 0

    def write_scalars(self, step, scalars):
        scalars = {k: float(v) for k, v in scalars.items()}
        self.calls.append(("scalars", step, scalars))
        self.scalars.append((step, scalars))

    def write_histograms(self, step, arrays):
        self.calls.append(("histograms", step, dict(arrays)))

    def write_images(self, step, images):
        self.calls.append(("images", step, dict(images)))

    def write_texts(self, step, texts):
        self.calls.append(("texts", step, dict(texts)))

    def write_hparams(self, hparams):
        self.calls.append(("hparams", None, dict(hparams)))

    def flush(self):
        self.calls.append(("flush",))
        self.flushes += 1

    def close(self):
        self.calls.append(("close",))
        self.closes += 1

    def steps(self, tag="global_step/sec"):
        return [step for step, scalars in self.scalars if tag in scalars]


# -- the platform: child processes on the CPU, workloads sized per backend ------------------------


#: XLA flags of the suite on the CPU (conftest.py), here and in child processes: no LLVM
#: optimisations, which cost more to run than they save on the suite's small programs
#: (nor LLVM's expensive passes: a one-layer `configs/lm.py` compiles in 0.9 s less CPU).
SUITE_XLA_FLAGS = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"


def cpu_env(devices: int | None = None) -> dict[str, str]:
    """The environment of a child JAX process on the CPU, whatever this process runs on.

    `JAX_PLATFORMS=cpu` whatever this process's JAX_PLATFORMS says: simulated devices
    (`XLA_FLAGS=--xla_force_host_platform_device_count`) exist on the CPU platform alone,
    and processes on 127.0.0.1 share no accelerator. `devices` simulated CPU devices, or
    (None) this process's device count dropped: one device. XLA_FLAGS holds those and
    `SUITE_XLA_FLAGS`. Output unbuffered, for tests that read it line by line. The rest
    (JAX_DEFAULT_MATMUL_PRECISION, set by conftest.py) is inherited.
    """
    if devices is not None and (isinstance(devices, bool) or not isinstance(devices, int) or devices < 1):
        raise ValueError(f"cpu_env(devices={devices!r}): give a number of simulated CPU devices >= 1, "
                         "or None for one device")
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1"}
    env["XLA_FLAGS"] = SUITE_XLA_FLAGS
    if devices is not None:
        env["XLA_FLAGS"] += f" --xla_force_host_platform_device_count={devices}"
    return env


def free_port() -> int:
    """A TCP port free on 127.0.0.1 just now, for a coordinator of child processes."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def slow_matmuls() -> tuple[int, int]:
    """(size, count): `count` products of (size, size) float32 matrices take tens of
    milliseconds on the default backend, so a step of them executes slower than a few
    runs dispatch (384 and 30 on a CPU: about 3 GFLOP; 4096 and 8 elsewhere: about 1.1
    TFLOP, some 30 ms on an H100 at float32 precision)."""
    return (384, 30) if jax.default_backend() == "cpu" else (4096, 8)


def signal_between_saves(config, workdir, signum, root):
    """Runs `jaxmon train` with saves 600 s apart, sends `signum` a second after its
    step-0 save (training has started), and returns the `CompletedProcess`."""
    args = [sys.executable, "-m", "jaxmon", "train", "--config", str(config), "--workdir", str(workdir),
            "--config.steps=100000", "--config.session.save_checkpoint_steps=None",
            "--config.session.save_checkpoint_secs=600", "--config.hooks.1.every_n_steps=100000"]
    process = subprocess.Popen(args, cwd=root, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while jm.latest_checkpoint_step(workdir) is None:  # the step-0 save: training has started
            assert time.monotonic() < deadline and process.poll() is None
            time.sleep(0.2)
        time.sleep(1.0)
        process.send_signal(signum)
        out, err = process.communicate(timeout=120)
    finally:
        process.kill()
    return subprocess.CompletedProcess(args, process.returncode, out, err)
