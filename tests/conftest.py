"""Strict JAX settings for the whole suite.

The platform: the CPU unless JAX_PLATFORMS is set, which is honoured (the empty string:
JAX's default platforms, e.g. a GPU with the CPU beside it, as `make test-gpu` runs).
Float32 matmuls at float32 precision, here and in the child processes (which inherit
the variable): a GPU's default, TF32, differs by ~1e-3 and the comparisons allow 1e-5.
No process preallocates a GPU's memory.
"""

import logging
import os
import shutil
import signal
import tempfile

# Ctrl-C delivered, whoever started the suite: a shell without job control starts a
# background job (`make test &`, `nohup`) with SIGINT ignored, which every process
# started from here would inherit, and `jaxmon` keeps a SIGINT ignored from the start
# ignored (as `nohup` means it). The tests of Ctrl-C send it to this process and to
# their child commands, and expect it handled.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["JAX_DEFAULT_MATMUL_PRECISION"] = "float32"
# On a GPU, JAX takes 75% of its memory when a process starts; the test workers and the
# JAX processes the tests start (which inherit the variable) share one GPU: none preallocates.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
# A suite started under `nohup` inherits SIGHUP ignored, and so would every `jaxmon train`
# it starts (jaxmon keeps an ignored SIGHUP ignored): the SIGHUP tests need its default.
if signal.getsignal(signal.SIGHUP) is signal.SIG_IGN:
    signal.signal(signal.SIGHUP, signal.SIG_DFL)

# On the CPU, XLA compiles without LLVM's optimisations (`helpers.SUITE_XLA_FLAGS`): the
# suite's programs are small and run few steps, so compiling them costs more than running
# them (a tiny transformer: 14 s of CPU instead of 20). The results are those of the
# optimised code to rounding; each comparison runs both sides with the same flags.
# (`helpers` is tests/helpers.py: pyproject.toml's `pythonpath` puts tests/ on sys.path.)
if os.environ["JAX_PLATFORMS"] == "cpu":
    from helpers import SUITE_XLA_FLAGS

    os.environ["XLA_FLAGS"] = " ".join(filter(None, [os.environ.get("XLA_FLAGS"), SUITE_XLA_FLAGS]))

# One persistent compilation cache for the whole suite, this process and its children
# (which inherit the variables): the suite compiles the same small programs in many
# tests and child processes. Removed at the end; a cache given from outside is kept.
_OWN_CACHE = None if os.environ.get("JAX_COMPILATION_CACHE_DIR") else tempfile.mkdtemp(prefix="jaxmon-tests-cache-")
if _OWN_CACHE:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _OWN_CACHE
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_numpy_rank_promotion", "raise")
jax.config.update("jax_default_matmul_precision", "float32")


def pytest_configure(config):
    config.addinivalue_line("markers", "needs_cpu: skipped where this process has no CPU device "
                            "(JAX_PLATFORMS=cuda, say), e.g. for jax.debug.callback's host side")
    # pytest-xdist's `--dist loadfile` hands out the files with the most tests first, which
    # leaves the files of a few long tests (several JAX processes, minutes) to the end: one
    # worker runs them while the other has nothing left. The files go out in the order
    # collected instead, the heavy ones first (`pytest_collection_modifyitems`).
    config.option.loadscopereorder = False


def pytest_collection_modifyitems(config, items):
    """The files with a `slow` or `processes` test first (each file's tests together and in
    their order): with two workers taking a file at a time, the light files come last and
    fill the time until the other worker's last heavy file ends."""
    heavy = {item.path for item in items if item.get_closest_marker("slow") or item.get_closest_marker("processes")}
    items.sort(key=lambda item: item.path not in heavy)


def pytest_unconfigure(config):
    if _OWN_CACHE:
        shutil.rmtree(_OWN_CACHE, ignore_errors=True)


def pytest_runtest_setup(item):
    if item.get_closest_marker("needs_cpu") and not has_cpu_device():
        pytest.skip(f"needs a CPU device: JAX_PLATFORMS={os.environ['JAX_PLATFORMS']!r} leaves none "
                    "(unset, empty or naming cpu gives one)")


@pytest.fixture
def logs(caplog):
    """`caplog` recording jaxmon's INFO lines and above."""
    caplog.set_level(logging.INFO, logger="jaxmon")
    return caplog


def has_cpu_device() -> bool:
    try:
        return bool(jax.devices("cpu"))
    except RuntimeError:  # "Unknown backend: 'cpu' requested, but no platforms ..."
        return False
