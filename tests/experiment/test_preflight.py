"""`check_experiment`, what `jaxmon check` prints: a tiny config built and compiled but not
trained, its parameters per module, the state and batch with their shardings, and each
program's compile time and memory."""

import jax
import pytest
from helpers import tiny_config

import jaxmon as jm
from jaxmon._experiment.preflight import check_experiment


@pytest.fixture
def config(tmp_path):
    return jm.load_config(tiny_config(tmp_path, steps=10))  # an MLP of 16 units on 8x8 digits, batches of 16


def test_the_report_of_a_config_on_one_device(config):
    config["session"]["steps_per_dispatch"] = 4
    report = check_experiment(config)
    assert report["config"] == config
    assert report["parameters"] == {"Dense_0": 64 * 16 + 16, "Dense_1": 16 * 10 + 10, "total": 1210}
    assert report["mesh"] is None and report["devices"] == [str(device) for device in jax.devices()]
    rows = {row["path"]: row for row in report["state"]}
    assert rows["state.params['Dense_0']['kernel']"] == {"path": "state.params['Dense_0']['kernel']",
                                                         "shape": [64, 16], "dtype": "float32",
                                                         "sharding": "one device"}
    assert rows["state.step"]["shape"] == [] and rows["state.step"]["dtype"] == "int32"
    assert "state.opt_state[0].mu['Dense_1']['bias']" in rows  # the optimizer's state too
    assert report["batch"] == {"x": {"shape": [16, 8, 8, 1], "dtype": "float32", "sharding": None},
                               "y": {"shape": [16], "dtype": "int32", "sharding": None}}
    names = [program["name"] for program in report["programs"]]
    assert names == ["step, runs of 1 step", "step, runs of 4 steps", "evaluation, one batch"]
    first = report["programs"][0]
    assert report["compile_secs"] == first["compile_secs"] > 0
    assert report["memory_per_device"] == first["memory_per_device"]
    assert all(program["memory_per_device"]["argument"] > 0 for program in report["programs"])


def test_a_mesh_and_fsdp_place_the_state_and_the_batch(config):
    config["mesh"] = {"data": -1}
    config["sharding"] = {"fsdp": "data"}
    report = check_experiment(config)
    assert report["mesh"] == {"data": jax.device_count()}
    rows = {row["path"]: row["sharding"] for row in report["state"]}
    assert rows["state.step"] == "replicated"
    assert rows["state.params['Dense_0']['kernel']"] == "P('data', None)"  # its largest dimension
    assert rows["state.params['Dense_0']['bias']"] == "P('data',)"
    assert {value["sharding"] for value in report["batch"].values()} == {"P('data',)"}


def test_a_config_error_is_raised_before_anything_is_built(config):
    config["stpes"] = 3
    with pytest.raises(jm.ConfigError, match="Unknown config key 'stpes'. Did you mean 'steps'?"):
        check_experiment(config)
