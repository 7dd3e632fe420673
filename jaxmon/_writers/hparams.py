"""Hyper-parameters as one level of bools, numbers and strings, as both writers store them."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from jaxmon._base.paths import flatten


def flat_hparams(hparams: Mapping[str, Any]) -> dict[str, bool | int | float | str]:
    """Hyper-parameters as one level, `{"model.width": 64}`, each a bool, number or str."""
    return {key: _hparam_value(value) for key, value in flatten(hparams, ".").items()}


def _hparam_value(value: Any) -> bool | int | float | str:
    if isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, np.generic):
        return value.item()
    return str(value)
