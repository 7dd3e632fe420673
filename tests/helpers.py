"""Small shared pieces for the tests: a recording hook, tiny step and init functions,
endless data, what a mean over steps gives, a session run to its end, fake clocks, the
log lines hooks write, the environment of child JAX processes, and `jaxmon train` run as
a user runs it.

tests/ is on sys.path (pyproject.toml's `pythonpath`), so every test file, in whichever
folder, imports this one module as `helpers`; a child process that imports it gets
`with_helpers_path(env)`."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import pathlib
import re
import signal
import socket
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from warm_processes import popen, run_jaxmon

import jaxmon as jm
from jaxmon._ops import report_thread

#: The test suite's folder, and the repository's (where `jaxmon train` runs from).
TESTS = pathlib.Path(__file__).resolve().parent
ROOT = TESTS.parent


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


def window_means(values, steps, start=0, opening=True):
    """What reduce="mean" gives at each of `steps`: the mean of `values[t]` (step t's output)
    over the steps of its window (see `windows`)."""
    return [float(np.mean([values[t] for t in window])) for window in windows(steps, start, opening)]


def windows(steps, start=0, opening=True):
    """The steps each report at `steps` covers: those after the previous report (or after
    `start`, where the session began) up to it; with `opening` (a period over 1 step), a
    report after step 1 of a session from step 0 (the starting point) ends no window:
    the next covers the steps from 1."""
    lows = [start, *steps[:-1]]
    if opening and start == 0 and len(steps) > 1 and steps[0] == 1:
        lows[1] = 0
    return [range(lo + 1, hi + 1) for lo, hi in zip(lows, steps, strict=True)]


def events(log, event):
    return [name for name, e in log if e == event]


# -- a session run to its end -------------------------------------------------------------------


def run_loop(sess, started=None):
    """Runs `sess` until it should stop; appends the step each run starts at to `started`."""
    while not sess.should_stop():
        if started is not None:
            started.append(sess.step)
        sess.run()


def train_on(sess):
    """Enters `sess`, runs it until it should stop and closes it; returns it."""
    with sess:
        run_loop(sess)
    return sess


def warnings_of(caplog):
    """The messages of jaxmon's log records at WARNING and above, in order."""
    return [r.getMessage() for r in caplog.records if r.name == "jaxmon" and r.levelno >= logging.WARNING]


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


def dispatch_secs(sess, below, runs=5, tries=2):
    """The seconds of `runs` calls of `sess.run()`, the device idle at the start: the least
    of up to `tries`, each tried again only while not `below` seconds (a try that the
    machine's load slowed down is not what dispatching takes, as `step_times`' least is
    what a step takes)."""
    least = float("inf")
    for _ in range(tries):
        jax.block_until_ready(sess.state)
        start = time.perf_counter()
        for _ in range(runs):
            sess.run()
        least = min(least, time.perf_counter() - start)
        if least < below:
            break
    return least


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


class FakeTime:
    """A clock that only moves when `sleep` is called (or `advance` by hand)."""

    def __init__(self, start=0.0):
        self.now = start
        self.sleeps = []

    def clock(self):
        return self.now

    def sleep(self, secs):
        self.sleeps.append(secs)
        self.now += secs

    def advance(self, secs):
        self.now += secs


# -- hooks in sessions: steps, runs and their log lines -----------------------------------------


def float_count(state, batch):
    """Adds 1. to a scalar float counter; outputs the new value as "value"."""
    state = state + 1.0
    return state, {"value": state}


def float_loss_step(state, batch):
    """A counter whose "loss" output is 1 / the new count, a float."""
    state = state + 1
    return state, {"loss": 1.0 / state.astype(jnp.float32)}


def scaled_eval(state, batch):
    """An eval_fn: "loss" the mean of state * x, "acc" the mean of x."""
    return {"loss": (state * batch["x"]).mean(), "acc": batch["x"].mean()}


#: Three eval batches of 4 rows, x = 1, 2 and 3.
EQUAL_BATCHES = [{"x": np.ones((4,), np.float32) * k} for k in (1, 2, 3)]


def run_n(sess, n, clock=None, dt=0.0, batch=None):
    """Runs `sess` `n` times, moving `clock` (a FakeClock) on by `dt` after each run."""
    for _ in range(n):
        sess.run(batch)
        if clock is not None:
            clock.t += dt


def info_lines(caplog, steps=None):
    """The jaxmon INFO lines; a LoggingHook line's "step N: " prefix is checked (it must be
    there) and taken off, its steps appended to `steps` when given; read once the report
    thread has written every line queued so far."""
    report_thread.wait()
    lines = []
    for r in caplog.records:
        if r.name == "jaxmon" and r.levelno == logging.INFO:
            message = r.getMessage()
            if " = " in message:  # a LoggingHook line in the default format
                match = re.match(r"step (\d+): (.*)", message)
                assert match, message
                if steps is not None:
                    steps.append(int(match[1]))
                message = match[2]
            lines.append(message)
    return lines


def all_warnings(caplog):
    """The messages of every log record at WARNING and above, of any logger, in order."""
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


# -- summaries: a session of float outputs -------------------------------------------------------


def summary_step(state, batch):
    """A float counter s with outputs "loss" (2 s), "acc" (s / 10) and "vec" (3 entries of s)."""
    state = state + 1.0
    return state, {"loss": state * 2, "acc": state / 10, "vec": jnp.ones(3) * state}


def checked_summary_step(state, batch):
    """`summary_step` that fails (at trace time) for a batch other than a scalar."""
    if jnp.ndim(batch) != 0:
        raise ValueError("this step wants a scalar batch")
    return summary_step(state, batch)


def run_summaries(hooks, runs, clock=None, dt=0.0):
    """Runs a session of `summary_step` with `hooks` for `runs` steps (advancing `clock` by
    `dt` after each) and closes it; returns the session."""
    with jm.MonitoredSession(summary_step, float_zero, hooks=hooks) as sess:
        for _ in range(runs):
            sess.run()
            if clock is not None:
                clock.t += dt
    return sess


def read_events(logdir):
    """The event files of `logdir` read by TensorBoard's own reader, every record kept."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0, "histograms": 0, "images": 0, "tensors": 0})
    acc.Reload()
    return acc


def event_scalars(acc, tag):
    """(step, value) of each scalar `tag` an `EventAccumulator` read."""
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def event_files(logdir):
    """The names of the event files in `logdir`."""
    return sorted(name for name in os.listdir(logdir) if name.startswith("events.out.tfevents"))


def read_jsonl(path):
    """The lines of a JSON-lines file (metrics.jsonl), each parsed."""
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def expected_outputs(steps, reduce):
    """`summary_step`'s "loss" and "acc" as written at `steps`: the state after step t is
    t, so loss = 2 t and acc = t / 10 (in float32); reduce="last" takes the write step's."""
    picked = windows(steps) if reduce == "mean" else [np.array([s]) for s in steps]
    loss = [float(np.mean(2.0 * np.float32(ts))) for ts in picked]
    acc = [float(np.mean(np.float32(ts) / np.float32(10))) for ts in picked]
    return loss, acc


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
    `SUITE_XLA_FLAGS`. Output unbuffered, for tests that read it line by line. No
    TF_CPP_MIN_LOG_LEVEL: JAX's import put one into this process's environment, where a
    shell gives a child none. The rest (JAX_DEFAULT_MATMUL_PRECISION, set by
    conftest.py) is inherited.
    """
    if devices is not None and (isinstance(devices, bool) or not isinstance(devices, int) or devices < 1):
        raise ValueError(f"cpu_env(devices={devices!r}): give a number of simulated CPU devices >= 1, "
                         "or None for one device")
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1"}
    env.pop("TF_CPP_MIN_LOG_LEVEL", None)
    env["XLA_FLAGS"] = SUITE_XLA_FLAGS
    if devices is not None:
        env["XLA_FLAGS"] += f" --xla_force_host_platform_device_count={devices}"
    return env


def with_helpers_path(env: dict[str, str]) -> dict[str, str]:
    """`env` with tests/ first on PYTHONPATH: for a child process that imports `helpers`
    (a test file run as a script, a worker script that imports it)."""
    return {**env, "PYTHONPATH": os.pathsep.join(filter(None, [str(TESTS), env.get("PYTHONPATH")]))}


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
    process = popen(args, cwd=root, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
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


# -- `jaxmon train` as a user runs it: its exit code, its last line, what it saved ---------------

#: The default experiment (what `make train` runs).
DEFAULT = str(ROOT / "configs" / "default.py")
#: Only checkpoints write (no summaries, step counter or evaluations), every 10 steps.
# (The compilation cache is the suite's, outside the workdir: see conftest.py.)
SAVES_ONLY = ["--config.session.save_summaries_steps=None", "--config.session.log_step_count_steps=None",
              "--config.hooks.1.every_n_steps=None", "--config.session.save_checkpoint_steps=10",
              "--config.session.max_to_keep=None"]


def train(workdir, *args, config=DEFAULT, timeout=240):
    """`jaxmon train --config CONFIG --workdir WORKDIR ARGS...` in a child process, from the
    repository; its `CompletedProcess`, output captured. The child is forked from a process
    that has imported what `jaxmon train` imports (`warm_processes.py`)."""
    return run_jaxmon(["train", "--config", config, "--workdir", workdir, *args], cwd=ROOT,
                      env={**os.environ, "PYTHONUNBUFFERED": "1"}, timeout=timeout)


def assert_fails(result, code, *words):
    """Exit `code`; the last line of stderr names the problem (`words`); under 15 lines."""
    output = (result.stdout + result.stderr).strip().splitlines()
    assert result.returncode == code, result.stderr[-3000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("jaxmon train: "), last
    for word in words:
        assert word in last, (word, last)
    assert len(output) < 15, "\n".join(output)
    assert "Traceback" not in result.stderr
    return last


def assert_same_checkpoint(workdir, reference, step):
    """Checkpoint `step` of `workdir` holds the state of `reference`'s, bit for bit."""
    got, want = jm.restore_checkpoint(workdir, step=step), jm.restore_checkpoint(reference, step=step)
    assert got.step == want.step == step
    for a, b in zip(jax.tree.leaves(got.state), jax.tree.leaves(want.state), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@contextlib.contextmanager
def tmpfs(path, size):
    """A tmpfs of `size` at `path` (the test is skipped where it cannot be mounted)."""
    path.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                             capture_output=True, text=True)
    if mounted.returncode:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {mounted.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


# -- a tiny experiment for `jaxmon train --processes 2` ------------------------------------------

_TINY_CONFIG = '''
def get_config():
    return {{
        "name": "tiny-digits",
        "seed": 0,
        "steps": {steps},
        "data": {{"source": "jaxmon.datasets:digits", "batch_size": 16, "eval_batch_size": 40}},
        "model": {{"name": "jaxmon.models:MLP", "features": [16], "num_outputs": 10}},
        "task": "classification",
        "optimizer": {{"name": "adam", "learning_rate": 2e-3}},
        "hooks": [{{"name": "EvalHook", "every_n_steps": 20}}, {{"name": "NanHook"}}{slow}],
        "session": {{"save_checkpoint_steps": 20, "save_summaries_steps": 10, "log_step_count_steps": 20,
                     "max_to_keep": 10{session}}},
    }}
'''

_SLOWDOWN = '''
import os
import sys
import time

import jaxmon as jm


class Sleep(jm.Hook):
    """Sleeps after each run: a run long enough to interrupt."""

    def __init__(self, secs):
        self.secs = secs

    def after_run(self, ctx, values):
        time.sleep(self.secs)


class LateCompiles(jm.Hook):
    """On the process $LATE_COMPILE_PROCESS (with $LATE_COMPILE_SECS set), the first compile
    of each program named in $LATE_COMPILES ("jit_variant:2,jit__traced:1": the first two
    step programs, the first evaluation's) takes that many seconds longer: a process that
    compiles from scratch while another finds its programs in the cache, or is loaded."""

    def __init__(self):
        secs = float(os.environ.get("LATE_COMPILE_SECS", "0"))
        if secs and os.environ.get("JAX_PROCESS_ID") == os.environ.get("LATE_COMPILE_PROCESS", "1"):
            _slow_compiles(secs, dict(item.split(":") for item in os.environ["LATE_COMPILES"].split(",")))


def _slow_compiles(secs, counts):
    from jax._src import compiler
    from jax._src.interpreters import mlir

    real, left, seen = compiler.compile_or_get_cached, {name: int(n) for name, n in counts.items()}, set()

    def late(backend, computation, *args, **kwargs):
        name = mlir.ir.StringAttr(computation.operation.attributes["sym_name"]).value
        text = str(computation)
        if left.get(name, 0) > 0 and text not in seen:
            left[name] -= 1
            seen.add(text)
            print(f"LateCompiles: {name} {secs:g} s late", file=sys.stderr, flush=True)
            time.sleep(secs)
        return real(backend, computation, *args, **kwargs)

    compiler.compile_or_get_cached = late
'''


def tiny_config(directory: pathlib.Path, steps: int, sleep: float = 0.0, *, late_compiles: bool = False,
                session: str = "") -> pathlib.Path:
    """Writes `directory/tiny.py`, an MLP on digits trained for `steps` steps (with
    `directory/slowdown.py`'s hook sleeping `sleep` s after each run, if given, and its
    `LateCompiles` with `late_compiles`); its path. `session`: more session keys
    (`'"steps_per_dispatch": 2'`)."""
    slow = f', {{"name": "slowdown:Sleep", "secs": {sleep}}}' if sleep else ""
    slow += ', {"name": "slowdown:LateCompiles"}' if late_compiles else ""
    (directory / "slowdown.py").write_text(_SLOWDOWN)
    path = directory / "tiny.py"
    path.write_text(_TINY_CONFIG.format(steps=steps, slow=slow, session=f", {session}" if session else ""))
    return path


def programs_for(lengths, scan_unroll="auto") -> int:
    """How many programs a session compiles for one fetch set whose runs had `lengths`, by
    the platform's program choice: one for every length ("auto" on CPU), else one per
    length the runs had, and the one-step program (compiled ahead for the step-by-step runs)."""
    from jaxmon._run.scan_unroll import dynamic_length

    return 1 if dynamic_length(scan_unroll, jax.default_backend()) and max(lengths) > 1 else len(set(lengths) | {1})


def kill_once_checkpointed(command, workdir, step, pick=None, env=None, stderr=None):
    """Starts `command`, SIGKILLs it (or the child process `pick(pid)` chooses) once
    checkpoint `step` is complete, and returns (exit code, seconds from the kill to its
    end, the pids of its children when killed); its stderr goes to the file `stderr`."""
    with open(stderr or os.devnull, "w") as err:
        process = popen(command, cwd=ROOT, env=env or cpu_env(), stdout=subprocess.DEVNULL, stderr=err)
    try:
        deadline = time.monotonic() + 400
        while (jm.latest_checkpoint_step(workdir) or 0) < step:
            assert process.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        children = [int(pid) for pid in open(f"/proc/{process.pid}/task/{process.pid}/children").read().split()]
        victim = process.pid if pick is None else pick(process.pid)
        killed = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        code = process.wait(timeout=120)
        return code, time.monotonic() - killed, children
    finally:
        process.kill()


_TRACKED = """
def get_config():
    return {
        "seed": 0, "steps": 50,
        "data": {"source": "jaxmon.datasets:digits", "batch_size": 16, "eval_batch_size": 40},
        "model": {"name": "jaxmon.models:MLP", "features": [16], "num_outputs": 10},
        "task": "classification",
        "optimizer": {"name": "adam", "learning_rate": 2e-3},
        "hooks": [{"name": "EvalHook", "every_n_steps": 25}, {"name": "slowdown:Sleep", "secs": 0.05}],
        "session": {"save_checkpoint_steps": 10, "save_summaries_steps": 10},
        "writers": [WRITER],
    }
"""


def tracked_config(directory: pathlib.Path, writer: dict) -> pathlib.Path:
    """Writes `directory/tracked.py`: 50 steps of `tiny_config`'s MLP (a checkpoint every 10,
    evaluations at 25 and 50, 0.05 s after each run) with `writer` in its `writers`; its path."""
    tiny_config(directory, steps=1)  # its slowdown.py
    path = directory / "tracked.py"
    path.write_text(_TRACKED.replace("WRITER", repr(writer)))
    return path


def load_benchmark(name: str):
    """The module `benchmarks/<name>.py`, loaded by path (benchmarks/ is not a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"benchmarks_{name}", ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
