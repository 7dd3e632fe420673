"""`debug_host_syncs`: a device value read on the host where no read belongs raises, and
so does a host value copied to the device implicitly in a dispatch.

With `debug_host_syncs=True` a session runs the data iterator, and every hook that is
called on every run (one without `next_trigger`), under `HostSyncs.guard(where)`: JAX's
`transfer_guard_device_to_host("disallow")` (which catches such a read on GPU and TPU),
and a check of jaxmon's own at the array's host conversions (`float()`, `np.asarray`,
`.item()`, `.tolist()`, formatting, ...), which also catches them on the CPU backend,
where JAX's guard lets them through (there `np.asarray` reads a CPU array through the
buffer protocol, which neither sees). The error names where the read happened; a hook's
error note adds the event and the step. Reads at a hook's trigger (its fetches, its
accumulators) are what triggers are for, and stay allowed.

Copies to the device are checked at the dispatch, where on a GPU a copy waits for the
device's queue: a run's batch that reaches it on the host (given to `run()`, or taken
from `data` with `prefetch=0`) raises (`refuse_host_batch`), and each dispatch runs under
`transfer_guard_host_to_device("disallow")` (`copies`): jaxmon sends every batch, feed
and argument itself, explicitly, so an implicit copy there is one nobody asked for.
"""

from __future__ import annotations

import contextlib
import functools
import re
import threading
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


class HostSyncError(RuntimeError):
    """A device value was read on the host where `debug_host_syncs=True` allows none."""


#: The host conversions of a JAX array that read its value from the device.
_READS = ("__array__", "__float__", "__int__", "__bool__", "__index__", "__complex__", "__format__", "__str__",
          "item", "tolist", "tobytes")
#: A batch's leaves that live on the host (NumPy arrays, Python numbers): a step copies them to the device.
HOST_VALUES = (np.ndarray, np.generic, bool, int, float, complex)
#: The value in JAX's error for a copy `transfer_guard_host_to_device("disallow")` refused.
_COPIED = re.compile(r"Disallowed host-to-device transfer: aval=(.*?)(?:, dst_sharding|$)", re.MULTILINE)
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

    @contextlib.contextmanager
    def copies(self, where: str) -> Iterator[None]:
        """An implicit host-to-device copy inside raises `HostSyncError`, naming `where`."""
        try:
            with jax.transfer_guard_host_to_device("disallow"):
                yield
        except Exception as error:
            copied = _COPIED.search(str(error))
            if copied is None:
                raise
            raise HostSyncError(
                f"debug_host_syncs: a host value ({copied.group(1)}) was copied to the device implicitly {where}. "
                "On a GPU the dispatch waits for such a copy. Give the step device arrays (jax.device_put, or "
                "data= whose batches the session sends ahead) instead of NumPy values captured or passed at the "
                "dispatch.") from error

    def refuse_host_batch(self, batch: Any, which: str) -> None:
        """Raises `HostSyncError` if `batch`, a run's (`which`), holds a host value: it
        would be copied to the device at its dispatch, not ahead."""
        for path, leaf in jax.tree_util.tree_leaves_with_path(batch):
            if isinstance(leaf, HOST_VALUES):
                shape = "x".join(map(str, np.shape(leaf))) or "scalar"
                raise HostSyncError(
                    f"debug_host_syncs: the batch {which} reached its dispatch on the host (batch"
                    f"{jax.tree_util.keystr(path)}, a {shape} {np.result_type(leaf)} value), so it is copied to "
                    "the device there: on a GPU the dispatch waits for the copy. Give the session data= with "
                    "prefetch >= 1 (it sends each run's batches to the device ahead of the run), or put batches "
                    "given to run() on the device ahead (jax.device_put).")

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
