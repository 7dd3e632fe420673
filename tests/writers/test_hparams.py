"""flat_hparams: hyper-parameters as one level of bools, numbers and strings."""

import numpy as np

from jaxmon._writers.hparams import flat_hparams


def test_nested_dicts_are_flattened_with_dots_in_order():
    hparams = {"lr": 0.1, "model": {"width": 64, "act": "relu", "head": {"bias": True}}, "seed": 0}
    assert flat_hparams(hparams) == {"lr": 0.1, "model.width": 64, "model.act": "relu", "model.head.bias": True,
                                     "seed": 0}
    assert list(flat_hparams(hparams)) == ["lr", "model.width", "model.act", "model.head.bias", "seed"]


def test_numpy_scalars_become_python_values_of_their_kind():
    flat = flat_hparams({"lr": np.float32(0.5), "steps": np.int64(3), "ema": np.bool_(True)})
    assert flat == {"lr": 0.5, "steps": 3, "ema": True}
    assert [type(value) for value in flat.values()] == [float, int, bool]


def test_any_other_value_is_written_as_its_str():
    flat = flat_hparams({"shape": (2, 3), "layers": [1, 2], "schedule": None, "dtype": np.dtype("float32")})
    assert flat == {"shape": "(2, 3)", "layers": "[1, 2]", "schedule": "None", "dtype": "float32"}
    assert flat_hparams({}) == {}
