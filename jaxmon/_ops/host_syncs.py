"""`debug_host_syncs`: a device value read on the host where no read belongs raises.

With `debug_host_syncs=True` a session runs the data iterator, and every hook that is
called on every run (one without `next_trigger`), under `HostSyncs.guard(where)`: JAX's
`transfer_guard_device_to_host("disallow")` (which catches such a read on GPU and TPU),
and a check of jaxmon's own at the array's host conversions (`float()`, `np.asarray`,
`.item()`, `.tolist()`, formatting, ...), which also catches them on the CPU backend,
where JAX's guard lets them through (there `np.asarray` reads a CPU array through the
buffer protocol, which neither sees). The error names where the read happened; a hook's
error note adds the event and the step. Reads at a hook's trigger (its fetches, its
accumulators) are what triggers are for, and stay allowed.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp


class HostSyncError(RuntimeError):
    """A device value was read on the host where `debug_host_syncs=True` allows none."""


#: The host conversions of a JAX array that read its value from the device.
_READS = ("__array__", "__float__", "__int__", "__bool__", "__index__", "__complex__", "__format__", "__str__",
          "item", "tolist", "tobytes")
_where = threading.local()  # .text: where the thread runs guarded (None: not guarded)
_installed: list[type] = []


def _install() -> None:
    """Wraps the host conversions of JAX's array class once per process: each checks
    whether its thread runs guarded (one attribute read when it does not)."""
    if _installed:
        return
    cls = type(jnp.zeros(()))
    for name in _READS:
        method = getattr(cls, name, None)
        if method is not None:
            setattr(cls, name, _checked(name, method))
    _installed.append(cls)


def _checked(name: str, method: Any) -> Any:
    @functools.wraps(method)
    def read(self: Any, *args: Any, **kwargs: Any) -> Any:
        where = getattr(_where, "text", None)
        if where is not None:
            _where.text = None  # formatting the error reads nothing more
            shape = "x".join(map(str, self.shape)) or "scalar"
            raise HostSyncError(
                f"debug_host_syncs: a device value was read on the host ({name} of a {shape} {self.dtype} array) "
                f"{where}. Such a read makes the host wait for the device on every run it happens in. Read values "
                "at a trigger instead (a hook whose next_trigger returns self.timer.next_trigger(step), with "
                "self.timer = jm.SecondOrStepTimer(every_steps=100), fetching them with RunArgs(fetches=..., "
                "late=True)), or reduce them on the device with accumulators (jm.Mean, ...).")
        return method(self, *args, **kwargs)

    return read


class HostSyncs:
    """The guards of one session (`enabled=False`: none, and nothing is installed)."""

    def __init__(self, enabled: bool):
        self.enabled = bool(enabled)
        if self.enabled:
            _install()

    @contextlib.contextmanager
    def guard(self, where: str) -> Iterator[None]:
        """Reads of device values inside raise `HostSyncError`, naming `where`."""
        outer = getattr(_where, "text", None)
        _where.text = where
        try:
            with jax.transfer_guard_device_to_host("disallow"):
                yield
        finally:
            _where.text = outer

    def iterator(self, data: Any) -> Any:
        """`data`'s iterator, each `next` guarded (its other members as they are)."""
        return _GuardedIterator(data, self) if self.enabled and data is not None else data


class _GuardedIterator:
    def __init__(self, data: Any, syncs: HostSyncs):
        self._data, self._syncs = data, syncs

    def __iter__(self) -> _GuardedIterator:
        return self

    def __next__(self) -> Any:
        with self._syncs.guard("in the data iterator, taking a batch"):
            return next(self._data)

    def close(self) -> None:  # grain's worker processes too
        from jaxmon._data.loaders import close_iterator

        close_iterator(self._data)

    def __getattr__(self, name: str) -> Any:  # get_state, set_state, ...
        return getattr(self._data, name)
