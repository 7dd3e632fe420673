"""The suite's child processes run on the CPU whatever platform the suite itself runs on
(`make test` the CPU, `make test-gpu` JAX's default platforms), at float32 precision."""

import json
import os
import re
import subprocess
import sys

import jax
import pytest
from helpers import SUITE_XLA_FLAGS, cpu_env

REPORT = ("import json, jax; print(json.dumps({'backend': jax.default_backend(), 'devices': jax.device_count(), "
          "'platforms': sorted({d.platform for d in jax.devices()}), "
          "'precision': jax.config.jax_default_matmul_precision}))")


def child_report(env: dict[str, str]) -> dict:
    result = subprocess.run([sys.executable, "-c", REPORT], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.splitlines()[-1])


@pytest.mark.parametrize("platforms", ["cuda", "tpu", ""])
def test_a_multi_device_child_runs_on_8_cpu_devices_whatever_jax_platforms_says(monkeypatch, platforms):
    monkeypatch.setenv("JAX_PLATFORMS", platforms)
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=2")  # replaced, not added to
    assert child_report(cpu_env(devices=8)) == {"backend": "cpu", "devices": 8, "platforms": ["cpu"],
                                                "precision": "float32"}


def test_a_child_of_a_multi_process_test_has_one_cpu_device(monkeypatch):
    monkeypatch.setenv("JAX_PLATFORMS", "cuda")
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")  # this process's flags dropped
    env = cpu_env()
    assert env["XLA_FLAGS"] == SUITE_XLA_FLAGS and env["PYTHONUNBUFFERED"] == "1"
    assert child_report(env) == {"backend": "cpu", "devices": 1, "platforms": ["cpu"], "precision": "float32"}


@pytest.mark.parametrize("devices", [0, -8, 2.0, "8", True])
def test_a_bad_device_count_is_refused_naming_it(devices):
    with pytest.raises(ValueError, match=re.escape(f"cpu_env(devices={devices!r})") + ".*>= 1"):
        cpu_env(devices=devices)


def test_the_suite_runs_on_the_platforms_jax_platforms_names_at_float32_precision():
    # conftest.py: the CPU unless JAX_PLATFORMS was set; "" is JAX's default platforms.
    platforms = os.environ["JAX_PLATFORMS"]
    if platforms:
        names = {"cuda": "gpu", "rocm": "gpu"}
        assert jax.default_backend() == names.get(platforms.split(",")[0], platforms.split(",")[0])
    assert jax.config.jax_default_matmul_precision == "float32"
    assert os.environ["JAX_DEFAULT_MATMUL_PRECISION"] == "float32"  # what child processes inherit


def test_no_jax_process_of_the_suite_preallocates_a_gpus_memory():
    # The test workers and the processes they start share one GPU under `make test-gpu`.
    assert os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] == "false"
    env = cpu_env(devices=2)
    report = subprocess.run([sys.executable, "-c", "import os; print(os.environ['XLA_PYTHON_CLIENT_PREALLOCATE'])"],
                            env=env, capture_output=True, text=True, timeout=60)
    assert report.stdout.strip() == "false"
