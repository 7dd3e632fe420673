"""Metrics over steps, on the device: reductions over every step's values, computed inside
the compiled step, carried between runs in one session-owned array, and read on the
host only at a trigger (see `Hook.accumulators`)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxmon._base.abstract import one_step
from jaxmon._base.hook import Hook
from jaxmon._base.host import to_host
from jaxmon._metrics.reductions import Reduction

logger = logging.getLogger("jaxmon")


class _Layout:
    """Where each accumulator's leaves sit in the one int32 array the session carries
    (float32 leaves as their bits), so that a run passes one extra array, not many."""

    def __init__(self, trees: list[Any]):
        self._treedefs, self._fields, offset = [], [], 0
        for tree in trees:
            leaves, treedef = jax.tree.flatten(tree)
            fields = []
            for leaf in leaves:
                if leaf.dtype not in (np.int32, np.float32):
                    raise TypeError(f"accumulator leaves must be int32 or float32; got {leaf.dtype}.")
                fields.append((offset, leaf.shape, leaf.dtype, int(np.prod(leaf.shape))))
                offset += fields[-1][3]
            self._treedefs.append(treedef)
            self._fields.append(fields)
        self.size = offset

    def pack_host(self, trees: list[Any]) -> np.ndarray:
        parts = [np.asarray(leaf, dtype).reshape(-1).view(np.int32)
                 for tree, fields in zip(trees, self._fields, strict=True)
                 for leaf, (_, _, dtype, _) in zip(jax.tree.leaves(tree), fields, strict=True)]
        return np.concatenate(parts) if parts else np.zeros(0, np.int32)

    def unpack_host(self, carry: np.ndarray, indices: Iterable[int] | None = None) -> list[Any]:
        """The trees numbered `indices` (None: all), from a host copy of the carry."""
        return [self._treedefs[i].unflatten([carry[o:o + n].view(dtype).reshape(shape)
                                             for o, shape, dtype, n in self._fields[i]])
                for i in (range(len(self._treedefs)) if indices is None else indices)]

    def pack(self, trees: list[Any], into: jax.Array) -> jax.Array:
        """The trees as one int32 array (traced), each leaf written at its offset in `into`
        (the carry the step took, donated: written in place): a chain of updates, where a
        concatenate of as many parts is not fused on the CPU and costs the step tens of µs.
        Leaves typed on a mesh (its explicit axes) are concatenated: an update must have
        its operand's sharding."""
        parts = []  # (offset, the leaf's bits)
        for tree, fields in zip(trees, self._fields, strict=True):
            for leaf, (offset, _, dtype, _) in zip(jax.tree.leaves(tree), fields, strict=True):
                leaf = jnp.asarray(leaf, dtype).reshape(-1)
                parts.append((offset, jax.lax.bitcast_convert_type(leaf, jnp.int32) if dtype == np.float32 else leaf))
        if any(_on_a_mesh(part) for _, part in parts):
            return jnp.concatenate([part for _, part in parts])
        carry = into
        for offset, part in parts:
            carry = jax.lax.dynamic_update_slice(carry, part, (offset,))
        return carry

    def unpack(self, carry: jax.Array) -> list[Any]:
        def field(offset, shape, dtype, size):
            bits = carry[offset:offset + size].reshape(shape)
            return jax.lax.bitcast_convert_type(bits, jnp.float32) if dtype == np.float32 else bits

        return [treedef.unflatten([field(*f) for f in fields])
                for treedef, fields in zip(self._treedefs, self._fields, strict=True)]

    def restart_mask(self, indices: Iterable[int]) -> np.ndarray:
        """True at every slot of the trees numbered `indices`."""
        mask = np.zeros(self.size, bool)
        for i in indices:
            for offset, _, _, size in self._fields[i]:
                mask[offset:offset + size] = True
        return mask


class _Entry(NamedTuple):
    """One accumulator: the hook that declared it, its name there, its reduction."""

    hook: Any
    name: str
    reduction: Reduction


class Accumulators:
    """The accumulators of a session's hooks: built on the first run from the shapes of
    the values, updated inside every compiled step (`update`, traced), carried between
    runs in one array this object owns, and read at triggers.

    A read (`read`, `read_now`) is a `Read`: whoever delivers it calls the `after_read`s
    of `read.after_reads()`, once.

    Args:
      hooks: the session's hooks; those with `accumulators` take part.
    """

    def __init__(self, hooks: Iterable[Any]):
        self._entries: list[_Entry] = []
        for hook in hooks:
            accumulators = hook.accumulators
            if not isinstance(accumulators, Mapping):
                raise TypeError(f"{hook!r}.accumulators must be a dict {{name: jm.Reduction}}; got {accumulators!r}.")
            for name, reduction in accumulators.items():
                if not isinstance(reduction, Reduction):
                    raise TypeError(f"{hook!r}.accumulators[{name!r}] is {reduction!r}, not a jm.Reduction "
                                    "(jm.Mean(...), jm.FirstNonFinite(...) or a subclass).")
                self._entries.append(_Entry(hook, name, reduction))
        self.active = bool(self._entries)
        self._hooks = list(dict.fromkeys(hook for hook, _, _ in self._entries))
        self._of_hook: dict[int, list[int]] = {}  # each hook's entries
        for i, (hook, _, _) in enumerate(self._entries):
            self._of_hook.setdefault(id(hook), []).append(i)
        #: The hooks told of every read: those with an `after_read` (the others' results wait until asked for).
        self.told = [hook for hook in self._hooks if getattr(type(hook), "after_read", None) is not Hook.after_read]
        self._layout: _Layout | None = None
        self._restart: dict[bytes, Callable[[jax.Array], jax.Array]] = {}  # by mask: one program each
        self._sharding: Any = None
        self._copy_ahead = False  # the carry is on an accelerator: a read starts its copy to the host at once
        #: The carry the next run starts from (`prepare`, then each run's by `advance`); None
        #: before the first run after `start`. Only this object sets it.
        self.carry: jax.Array | None = None
        self._since: dict[int, int] = {}
        self._last_read: Read | None = None
        self._saved: np.ndarray | None = None
        self.guards = any(type(r).accept is not Reduction.accept for _, _, r in self._entries)

    def start(self, step: int, saved: Mapping[str, Any] | None = None) -> None:
        """A state was created or restored at `step`: every accumulator starts afresh,
        or from `saved` (what `get_state` gave for that step's checkpoint)."""
        self.carry, self._last_read, self._saved = None, None, None
        self._since = {id(hook): step for hook in self._hooks}
        if saved and saved.get("entries") == self._signature():
            self._saved = np.asarray(saved["carry"], np.int32)
            self._since = {id(hook): since for hook, since in zip(self._hooks, saved["since"], strict=True)}
        elif saved:
            logger.warning("The checkpoint of step %d holds the windows of other reductions (%s); the hooks' "
                           "windows start afresh at step %d.", step, ", ".join(saved.get("entries", ())), step)

    def get_state(self, step: int) -> dict[str, Any] | None:
        """The open windows after the run that ended at `step` (JSON, for its
        checkpoint): the carry as the next run starts from it, and where each hook's
        window began; None when nothing accumulates."""
        if not self.active:
            return None
        if self.carry is None:
            host = self._saved
        else:
            self.read_now(step)
            read = self._last_read
            host = read.host_carry if read.mask is None else np.where(read.mask, self._fresh(), read.host_carry)
        if host is None:
            return None
        return {"entries": self._signature(), "carry": host.tolist(),
                "since": [self._since[id(hook)] for hook in self._hooks]}

    def _signature(self) -> list[str]:
        """The entries as a checkpoint names them: a hook declared in another's place
        (`Declared`) under that hook's name, so that every process's match the chief's."""
        return [f"{hook.label if isinstance(hook, Declared) else type(hook).__name__}.{name}={reduction!r}"
                for hook, name, reduction in self._entries]

    def _fresh(self) -> np.ndarray:
        return self._layout.pack_host([np.array(0, np.int32), *self._inits])

    def prepare(self, step_fn: Callable[..., Any], state: Any, batch: Any, *, program_steps: int, step: int,
                sharding: Any) -> jax.Array:
        """Builds the carry of the first run after `start` (the run after `step`), whose
        batch is stacked for `program_steps` steps."""
        if self._layout is None:
            one = one_step(batch, program_steps)

            def values(state, batch):
                new_state, outputs = step_fn(state, batch)
                return [reduction.value(new_state, batch, outputs) for _, _, reduction in self._entries]

            shapes = jax.eval_shape(values, state, one)
            self._inits = [reduction.init(shape) for (_, _, reduction), shape in zip(self._entries, shapes,
                                                                                      strict=True)]
            self._layout = _Layout([np.array(0, np.int32), *self._inits])
        host = self._layout.pack_host([np.array(step, np.int32), *self._inits])
        if self._saved is not None and self._saved.shape == host.shape:
            host = self._saved.copy()
            host[0] = step
        elif self._saved is not None:  # saved by a jaxmon whose reductions kept other fields
            self._since = {id(hook): step for hook in self._hooks}
            logger.warning("The checkpoint's windows have %d fields where these reductions keep %d; the hooks' "
                           "windows start afresh at step %d.", self._saved.size, host.size, step)
        if sharding is None:
            self.carry = jax.device_put(host)
        else:
            self.carry = jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])
        self._sharding = sharding
        self._copy_ahead = next(iter(self.carry.devices())).platform != "cpu"  # on the CPU, copying is reading
        return self.carry

    def advance(self, carry: jax.Array) -> None:
        """A run returned `carry`: the next run starts from it."""
        self.carry = carry

    def update(self, carry: jax.Array, state: Any, new_state: Any, batch: Any, outputs: Any) -> tuple[Any, jax.Array]:
        """One step's update (traced): the new carry, and the state to keep."""
        step, *accs = self._layout.unpack(carry)
        step = step + 1
        accs = [reduction.update(acc, reduction.value(new_state, batch, outputs), step)
                for (_, _, reduction), acc in zip(self._entries, accs, strict=True)]
        if self.guards:
            keep = [reduction.accept(acc) for (_, _, reduction), acc in zip(self._entries, accs, strict=True)]
            keep = [k for k in keep if k is not None]
            if keep:
                ok = jnp.all(jnp.stack(keep))
                new_state = jax.tree.map(lambda new, old: jnp.where(ok, new, old), new_state, state)
        carry = self._layout.pack([step, *accs], into=carry)
        if self._sharding is not None:  # one copy on every device, whatever the values' shardings
            carry = jax.lax.with_sharding_constraint(carry, self._sharding)
        return carry, new_state

    def read(self, step: int, readers: Sequence[Any], keeps: Sequence[Any] = ()) -> Read | None:
        """A read of the carry after the run that ended at `step` for `readers` (hooks
        that asked; None when none did): their accumulators start again from `step`,
        but for those in `keeps`, whose windows go on."""
        if not readers or not self.active or self.carry is None:
            return None
        return self._read(step, readers, [hook for hook in readers if not any(hook is k for k in keeps)])

    def _read(self, step: int, readers: Sequence[Any], restarting: Sequence[Any] = ()) -> Read:
        carry = self.carry
        mask, program = self._restart_of(restarting)
        read = self._last_read = Read(self, step, carry, mask, dict(self._since))
        if self._copy_ahead:  # behind the run on the device: done by the time the next run reads it
            (carry if carry.is_fully_addressable else carry.addressable_data(0)).copy_to_host_async()
        for hook in restarting:
            self._since[id(hook)] = step
        if program is not None:
            self.carry = program(carry)
        elif readers:  # the next run takes the carry it starts from (donated): the read keeps this one
            self.carry = _copy(carry)
        return read

    def read_now(self, step: int) -> Read | None:
        """A read of `step` on the host now (sync, save, close): the run's own, when a hook
        read at that step, else a new one; None before the first run."""
        if self._last_read is not None and self._last_read.step == step:
            read = self._last_read
        elif self.carry is not None:
            read = self._read(step, ())
        else:
            return None
        read.host()
        return read

    def _restart_of(self, readers: Sequence[Any]) -> tuple[np.ndarray | None, Any]:
        """The slots that a read by `readers` starts afresh (None: none), and the program
        that does it (one per set of slots)."""
        indices = [i + 1 for i, (hook, _, reduction) in enumerate(self._entries)
                   if reduction.restarts and any(hook is r for r in readers)]
        if not indices:
            return None, None
        mask = self._layout.restart_mask(indices)
        restart = self._restart.get(mask.tobytes())
        if restart is None:
            fresh = self._fresh()

            def restart(carry):
                return jnp.where(mask, fresh, carry)

            restart = self._restart[mask.tobytes()] = jax.jit(restart)
        return mask, restart

    def results(self, host: np.ndarray, steps: int, hook: Any) -> dict[str, Any]:
        """`hook`'s `{name: result}` from a host copy of the carry, its window `steps` long."""
        entries = self._of_hook.get(id(hook), ())
        trees = self._layout.unpack_host(host, [i + 1 for i in entries])
        return {self._entries[i].name: self._entries[i].reduction.result(tree, steps)
                for i, tree in zip(entries, trees, strict=True)}

    @property
    def compile_count(self) -> int:
        """How many restart programs were compiled (one per set of hooks read together)."""
        return len(self._restart)


class Declared(Hook):
    """The accumulators of `hook`, a hook that runs on the chief only, declared in its place
    on the other processes: every process compiles the same step, and its windows in a
    checkpoint match the chief's (they are never read here)."""

    def __init__(self, hook: Hook):
        self.accumulators = dict(hook.accumulators)
        self.label = type(hook).__name__

    def __repr__(self) -> str:
        return f"Declared({self.label}, {sorted(self.accumulators)})"


class Read:
    """One read of the accumulators: the carry after its run, copied to the host the first
    time it is needed (one run later, or at a `sync()`, a save or `close()`), and its
    `after_read`s, which the session's hook runner delivers once (`after_reads`)."""

    def __init__(self, accumulators: Accumulators, step: int, carry: jax.Array, mask: np.ndarray | None,
                 since: dict[int, int]):
        # `since`: the step each hook's window began at (by `id`), before this read.
        self._accumulators, self.step, self.carry, self._since = accumulators, step, carry, since
        #: The slots this read starts afresh (None: none), and the carry on the host once read.
        self.mask, self.host_carry = mask, None
        self._values: dict[int, dict[str, Any]] = {}
        self._delivered = False

    def host(self) -> None:
        """The carry on the host (read once)."""
        if self.host_carry is None:
            self.host_carry, self.carry = _read(self.carry), None

    def after_reads(self) -> list[tuple[Any, dict[str, Any]]]:
        """`[(hook, values)]` of every hook with an `after_read` (the others' values wait
        until asked for, on whichever thread asks), the first time asked; [] after."""
        if self._delivered:
            return []
        self._delivered = True
        return [(hook, self.values(hook)) for hook in self._accumulators.told]

    def values(self, hook: Any) -> dict[str, Any]:
        """`hook`'s results (computed once, when first asked for, on the thread that asks)."""
        values = self._values.get(id(hook))
        if values is None:
            self.host()
            values = self._values[id(hook)] = self._accumulators.results(
                self.host_carry, self.step - self._since.get(id(hook), self.step), hook)
        return values


_copy = jax.jit(jnp.copy)


def _read(carry: jax.Array) -> np.ndarray:
    """The carry on the host (one array: read as it is, the common case)."""
    return np.asarray(carry) if carry.is_fully_addressable else to_host(carry)


def _on_a_mesh(x: jax.Array) -> bool:
    """Whether `x` (traced) has a mesh in its type (explicit axes)."""
    mesh = getattr(getattr(jax.typeof(x), "sharding", None), "mesh", None)
    return mesh is not None and not mesh.empty
