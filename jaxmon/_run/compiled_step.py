"""The compiled step: the user's step function jitted once per fetch set."""

from __future__ import annotations

import concurrent.futures
import functools
import inspect
import logging
import numbers
import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxmon._base.abstract import abstract, abstract_run, one_step
from jaxmon._base.errors import with_article
from jaxmon._base.fetches import FetchSpec, paths
from jaxmon._ops.time_spent import TimeSpent
from jaxmon._processes.agree import every_process_at
from jaxmon._run.batches import on_device, stack_leaves
from jaxmon._run.scan_unroll import canonical_convolutions, convolves, dynamic_length, platform_of, resolve_scan_unroll

logger = logging.getLogger("jaxmon")
#: How long each compilation took (INFO), under its own name so that it can be silenced.
compile_log = logging.getLogger("jaxmon.compile")

#: More compiled variants than this suggests a fetch set that changes every run.
VARIANT_WARNING = 8


def trace_once(fn: Callable[..., Any], check: Callable[..., Any] | None = None) -> Callable[..., Any]:
    """`fn` as JAX traces it once per set of argument shapes, however many programs
    call it: the session's compiled variants (one per fetch set, one per run length)
    and the shapes read ahead of them (`jax.eval_shape`) share one trace of the
    user's function, which for a real model costs more than the rest of the
    program's. Each caller gets the same operations, inlined where it calls it.
    `check(result, *args)`, on trace, sees what `fn` returned before JAX does (and
    returns what the callers get), so that it can name a result JAX would refuse."""
    @functools.wraps(fn)
    def traced(*args):  # a function of ours: whatever `fn` is, JAX can key its cache on this
        result = fn(*args)
        return result if check is None else check(result, *args)

    return jax.jit(traced, inline=True)


def check_batch(batch: Any, step: int) -> None:
    """Refuses (before tracing) a batch the step cannot take, a leaf that is not an array or
    a number, naming the step and the key. (A batch with 0 rows is refused on trace.)"""
    for path, leaf in jax.tree_util.tree_leaves_with_path(batch):
        if not _array_like(leaf):
            shown = f"{type(leaf).__name__} {leaf!r}"[:120]
            raise TypeError(f"batch{jax.tree_util.keystr(path)} of step {step} is not an array of numbers: "
                            f"{shown}. A step takes arrays only: turn it into one in the data pipeline "
                            "(e.g. token ids for text), or drop the key from the batch.")


def _array_like(leaf: Any) -> bool:
    """Whether the step can take `leaf`: a number, or an array of anything but objects and text."""
    if isinstance(leaf, (bool, int, float, complex, np.number, np.bool_)):
        return True
    kind = getattr(leaf, "dtype", None)
    if kind is None:
        return False
    try:
        return np.dtype(kind).kind not in "OSU"
    except TypeError:  # a JAX extended dtype (PRNG keys)
        return True


def check_step_fn(step_fn: Any) -> None:
    """Raises a `TypeError` unless `step_fn` can be called as `step_fn(state, batch)`."""
    if not callable(step_fn):
        raise TypeError(
            f"step_fn must be a function step_fn(state, batch) -> (new_state, outputs); got {step_fn!r}."
        )
    try:
        signature = inspect.signature(step_fn)
    except (TypeError, ValueError):  # builtins and some C callables: trust them
        return
    try:
        signature.bind(None, None)
    except TypeError:
        name = getattr(step_fn, "__qualname__", repr(step_fn))
        raise TypeError(
            f"step_fn must take two positional arguments (state, batch); {name}{signature} "
            f"does not. Give it the signature step_fn(state, batch) -> (new_state, outputs)."
        ) from None


class CompiledStep:
    """Jits `step_fn` with each distinct set of fetch callables traced into the same program.

    Calling it with a key (a tuple of callables) returns `(new_state, outputs,
    fetched)` where `fetched` holds one value per callable. Each key is compiled once
    per run length (and again only if the shapes of the state or batch change);
    `trace_count` counts every trace, so tests can assert that nothing recompiles by
    accident. `evaluate` computes fetches on a given state, batch and outputs without
    a step.

    With several run `lengths`, each is compiled when a run first needs it, no
    earlier: the first call of a key compiles its program, and its one-step program
    (and that of the key without fetches, for the runs every hook sleeps through) in a
    background thread; a later run of a length not compiled yet starts that length's
    compilation in the background and runs its steps one by one meanwhile, so no run
    waits for a compile but the first of a key, and only the lengths the hooks'
    schedules produce are compiled.

    `unroll` is the session's `scan_unroll`: how far the `lax.scan` of a run of several
    steps is unrolled ("auto": see `scan_unroll.resolve_scan_unroll`, decided at the
    first call by the platform of the state's devices and whether the step convolves).
    Where `scan_unroll.dynamic_length` says so, one program per key takes every run of
    up to the longest length instead: its batch padded to that length (`program_steps`), the
    run's own length an argument of its loop.
    """

    def __init__(self, step_fn: Callable[..., Any], *, donate_state: bool = True, lengths: Sequence[int] = (1,),
                 accumulate: Callable[..., tuple[Any, Any]] | None = None, unroll: int | bool | str = 1,
                 spent: TimeSpent | None = None):
        check_step_fn(step_fn)
        self._spent = TimeSpent() if spent is None else spent
        self.traced_step_fn = trace_once(step_fn, lambda result, state, batch: _check_result(result, state))
        # The carry is the session's own: each run takes it (updated in place), and a read keeps a copy.
        self._donate = (0, 2) if donate_state else (2,)
        self._variants: dict[tuple[FetchSpec, ...], Callable[..., Any]] = {}
        self._evaluators: dict[tuple[FetchSpec, ...], Callable[..., Any]] = {}
        self._traces: list[int] = []  # one entry per trace (list.append is atomic across threads)
        self.lengths = tuple(lengths)
        self._most = max(self.lengths)
        self._dynamic: bool | None = None  # one program for every run length (`program_steps`), once known
        self._ahead: dict[tuple, concurrent.futures.Future] = {}  # (key, length) compiling in the background
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._first_batch: dict[str, str] | None = None  # {path: "dtype[shape]"} of the first traced batch
        self._step = 0  # the step before the run being dispatched (warnings name the next)
        # `accumulate(carry, state, new_state, batch, outputs) -> (carry, new_state)`: the
        # hooks' accumulators, traced into every step (see `_metrics.Accumulators.update`).
        self._accumulate = accumulate
        self._state_constraint: Callable[[Any], Any] | None = None
        self._unroll, self._platform, self._convolves = unroll, None, None
        self._ran = False  # with several processes, the first program waits for every process to compile it

    @property
    def trace_count(self) -> int:
        return len(self._traces)

    @property
    def constrained(self) -> bool:
        return self._state_constraint is not None

    def choose(self, state: Any) -> None:
        """Decides, once, what "auto" does on the platform of `state`'s devices: one
        program for every run length (`program_steps`), or one per length."""
        if self._dynamic is None:
            self._platform = platform_of(state)
            self._dynamic = self._most > 1 and dynamic_length(self._unroll, self._platform)
            if self._dynamic:
                self.lengths = (self._most,)

    @property
    def chosen(self) -> bool:
        """Whether `choose` was called: `program_steps` and `dynamic` are known."""
        return self._dynamic is not None

    @property
    def dynamic(self) -> bool:
        """Whether one program takes every run length, the length an argument (after `choose`)."""
        return bool(self._dynamic)

    def program_steps(self, length: int) -> int:
        """The leading axis of the batch a run of `length` steps is called with (after
        `choose`): the longest run length for every run up to it when one program takes
        them all (the batch padded, see `batches.pad_run`), else `length`."""
        return self._most if self._dynamic and length <= self._most else length

    def constrain_state(self, constraint: Callable[[Any], Any]) -> None:
        """Applies `constraint` to every new state inside the step (a sharded session
        keeps the state on its shardings with it); before the first call."""
        self._state_constraint = constraint

    def __call__(self, key: tuple[FetchSpec, ...], state: Any, batch: Any, *, owners: Mapping[FetchSpec, object],
                 program_steps: int = 1, length: Any = None, carry: Any = None, unfed: Any = None, step: int = 0,
                 listed: bool | None = None):
        """One dispatch after `step`: one step, or with `program_steps` > 1 that many steps
        scanned over the leading axis of `batch` (outputs and fetches of the last
        step); for a program that takes every run length, the first `length` of them
        (the run's length on the device: the batch is padded). With `accumulate`,
        `carry` is the accumulators before the run; the call then returns `(new_state,
        outputs, fetched, new_carry)`. `unfed` is `batch` without the hooks' feeds (the
        batch of a run without hooks), when they differ. `listed`: whether runs of
        several steps get their batches as a list (see `as_run`), for the programs
        compiled ahead; None: as `batch` shows."""
        self._step = step
        self.choose(state)
        variant = self._variants.get((key, program_steps))
        arguments = (state, batch, carry, length) if self._dynamic else (state, batch, carry)
        if variant is not None:
            ahead = self._ahead.get((key, program_steps))
            if ahead is not None and not ahead.done() and self._ready(key, 1) and not self.constrained:
                return self._step_by_step(key, state, batch, program_steps, carry)  # while its program compiles
            first = self._ahead.pop((key, program_steps), None) is not None  # its first call: compile time
            try:
                if not first:
                    return variant(*arguments)
                with self._spent.timing("compile"):
                    ahead.result()  # the rest of its compilation, if the background is not done yet
                    return variant(*arguments)  # the first call traces it again: JAX's caches hold the program
            except TypeError:  # JAX refused an argument: say which batch key, if it is the batch
                check_batch(batch, step + 1)
                raise
        check_batch(batch, step + 1)
        if self._convolves is None:  # the first call: what "auto" does depends on the step too
            self._convolves = (self._unroll == "auto" and self._platform == "cpu" and self._most > 1
                               and convolves(self.traced_step_fn, abstract(state), one_step(batch, program_steps)))
        ahead = len(self.lengths) > 1 and (abstract(state), abstract(carry))  # before the call donates the state
        if program_steps > 1 and self._ready(key, 1) and not self.constrained:  # a length the runs need now
            self._compile_ahead(key, owners, ahead, batch, program_steps, listed, lengths=(program_steps,))
            return self._step_by_step(key, state, batch, program_steps, carry)
        variant = self._variant(key, owners, program_steps)
        waited = 0.0
        with self._spent.timing("compile") as compiling:
            if not self._ran and jax.process_count() > 1:  # see `agree.every_process_at`
                variant.lower(*arguments).compile()
                waited = every_process_at("compiled the step")
            self._ran = True
            result = variant(*arguments)
        if waited >= 1:
            compile_log.info("Waited %.1f s for the other processes to compile the step.", waited)
        runs = f"up to {program_steps}" if self._dynamic else f"{program_steps}"
        steps = "step" if program_steps == 1 else "steps"
        values = "value" if len(key) == 1 else "values"
        compile_log.info("Compiled the step for runs of %s %s with %d fetched %s in %.2f s.", runs, steps, len(key),
                         values, compiling.secs - waited)
        if ahead:  # the one-step programs that let a later run of a new length go step by step
            self._compile_ahead(key, owners, ahead, batch, program_steps, listed, lengths=(1,))
            if key:
                self._compile_ahead((), {}, ahead, batch if unfed is None else unfed, program_steps, listed,
                                    lengths=(1,))
        return result

    def _ready(self, key: tuple[FetchSpec, ...], length: int) -> bool:
        """Whether the program of `key` for runs of `length` steps is compiled."""
        ahead = self._ahead.get((key, length))
        return (key, length) in self._variants and (ahead is None or ahead.done())

    def _step_by_step(self, key: tuple[FetchSpec, ...], state: Any, batch: Any, length: int, carry: Any) -> tuple:
        """A run of `length` steps as `length` calls of the one-step program, for a run
        whose own program is still compiling in the background: the same steps, results
        and fetches (of the last step), without waiting for the compilation."""
        single = self._variants[key, 1]
        for one in batch if isinstance(batch, list) else _unstacked(batch, length):
            result = single(state, one, carry)
            state, carry = result[0], result[3] if carry is not None else None
        return result

    def _variant(self, key: tuple[FetchSpec, ...], owners: Mapping[FetchSpec, object],
                 length: int) -> Callable[..., Any]:
        variant = self._variants[key, length] = self._build(key, dict(owners), length)
        if len(self._variants) > VARIANT_WARNING and len({k for k, _ in self._variants}) == VARIANT_WARNING + 1:
            logger.warning(
                "The step is now compiled for %d distinct fetch sets. A hook probably "
                "fetches a new callable each run (e.g. a lambda made in before_run): "
                "create the callable once and pass the same object every run.",
                len({k for k, _ in self._variants}),
            )
        return variant

    def _compile_ahead(self, key: tuple[FetchSpec, ...], owners: Mapping[FetchSpec, object], arguments: tuple,
                       batch: Any, length: int, listed: bool | None = None, *, lengths: Sequence[int]) -> None:
        """Compiles `key` for those of `lengths` it has no program for yet, in the background
        (`batch`, of a run of `length` steps, shows the batches' structure)."""
        todo = [n for n in lengths if (key, n) not in self._variants]
        if not todo:
            return
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(
                max_workers=max(1, min(len(self.lengths), (os.cpu_count() or 2) - 1)),
                thread_name_prefix="jaxmon-compile")
        state, carry = arguments
        one = one_step(batch, length)
        if listed is None:  # as `as_run` will give it
            listed = isinstance(batch, list) if length > 1 else on_device(batch)
        started = time.perf_counter()
        for n in todo:
            variant = self._variant(key, owners, n)
            run_batch = one if n == 1 else [one] * n if listed else abstract_run(one, n)
            self._ahead[key, n] = self._pool.submit(_compile, variant, (state, run_batch, carry), n, todo, started)

    def wait_ahead(self) -> None:
        """Waits for every compilation running ahead."""
        for future in list(self._ahead.values()):
            if not future.cancelled():  # by close()
                future.result()

    def close(self) -> None:
        """Drops the compilations ahead not started yet."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

    def _build(self, key: tuple[FetchSpec, ...], owners: dict[FetchSpec, object], length: int) -> Callable[..., Any]:
        accumulate, constraint = self._accumulate, self._state_constraint
        scan = resolve_scan_unroll(self._unroll, self._platform or jax.default_backend(), bool(self._convolves))
        step_fn = canonical_convolutions(self.traced_step_fn) if scan.canonical and length > 1 else self.traced_step_fn
        dynamic = self._dynamic and length == self._most

        def one_step(state, carry, batch):
            new_state, outputs = step_fn(state, batch)  # checked by `trace_once`
            if carry is not None:
                carry, new_state = accumulate(carry, state, new_state, batch, outputs)
            if constraint is not None:
                new_state = constraint(new_state)
            return new_state, carry, outputs

        def scanned(both, batch):
            state, carry, outputs = one_step(*both, batch)
            return (state, carry), outputs

        def variant(state, batch, carry, steps=None):
            if length > 1 and isinstance(batch, list):  # batches on the device, stacked inside this program
                batch = stack_leaves(batch)
            if length == 1:
                new_state, carry, outputs = one_step(state, carry, batch)
            elif dynamic:  # the last step's batch and outputs are what fetches see, as after one step
                new_state, carry, outputs, batch = _loop(one_step, state, carry, batch, steps)
            else:
                (new_state, carry), stacked = jax.lax.scan(scanned, (state, carry), batch, length=length,
                                                           unroll=scan.unroll)
                batch, outputs = jax.tree.map(lambda x: x[-1], (batch, stacked))
            fetched = tuple(_evaluate(spec, owners[spec], new_state, batch, outputs) for spec in key)
            self._check_batch_shapes(batch)
            self._traces.append(length)  # a trace that raised compiles nothing
            if carry is None:
                return new_state, outputs, fetched
            return new_state, outputs, fetched, carry

        return jax.jit(variant, donate_argnums=self._donate)

    def _check_batch_shapes(self, batch: Any) -> None:
        """Warns (on trace) when one step's batch has other shapes than the first: each
        new shape compiles the step again; refuses a batch with no rows."""
        shapes = {f"batch{jax.tree_util.keystr(path)}": f"{leaf.dtype}[{','.join(map(str, leaf.shape))}]"
                  for path, leaf in jax.tree_util.tree_leaves_with_path(batch) if hasattr(leaf, "shape")}
        empty = [path for path, leaf in jax.tree_util.tree_leaves_with_path(batch)
                 if getattr(leaf, "shape", (1,))[:1] == (0,)]
        if empty:
            raise ValueError(f"The batch of step {self._step + 1} is empty: batch{jax.tree_util.keystr(empty[0])} "
                             "has 0 rows. A loader that filters or splits its data can yield an empty batch at the "
                             "end of an epoch: drop it (drop_remainder=True) or skip empty batches.")
        if self._first_batch is None:
            self._first_batch = shapes
            return
        changed = [f"{path} {shapes[path]} (was {before})" for path, before in self._first_batch.items()
                   if path in shapes and shapes[path] != before]
        if changed:
            logger.warning(
                "The batch of step %d has other shapes than the first batch: %s. The step compiles "
                "again for every new shape (seconds on a real model, a stall mid-run). Give every batch one "
                "shape: pad the last one (and mask the padding), or drop it (ArrayDataSource drops it by "
                "default).", self._step + 1, "; ".join(changed))

    def evaluate(self, key: tuple[FetchSpec, ...], state: Any, batch: Any, outputs: Any, owners: Mapping) -> tuple:
        """The fetch callables of `key` on `(state, batch, outputs)`, jitted once per key."""
        if not key:
            return ()
        evaluator = self._evaluators.get(key)
        if evaluator is None:
            owners = dict(owners)

            def evaluator(state, batch, outputs):
                return tuple(_evaluate(spec, owners[spec], state, batch, outputs) for spec in key)

            evaluator = self._evaluators[key] = jax.jit(evaluator)
        return evaluator(state, batch, outputs)


@functools.partial(jax.jit, static_argnums=1)
def _unstacked(batch: Any, length: int) -> list[Any]:
    """A stacked batch on the device as the list of its `length` steps' batches, on the
    device (one program: indexing a device array from the host copies the index)."""
    return [jax.tree.map(lambda x, i=i: x[i], batch) for i in range(length)]


def _loop(one_step: Callable[..., tuple], state: Any, carry: Any, batch: Any, steps: Any) -> tuple:
    """The first `steps` (traced) steps of the stacked `batch` in one loop: the new state
    and carry, and the last step's outputs and batch."""
    def step_batch(i):
        return jax.tree.map(lambda x: jax.lax.dynamic_index_in_dim(x, i, keepdims=False), batch)

    shapes = jax.eval_shape(one_step, state, carry, step_batch(0))[2]
    outputs = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
    state, carry, outputs = jax.lax.fori_loop(0, steps, lambda i, loop: one_step(loop[0], loop[1], step_batch(i)),
                                              (state, carry, outputs))
    return state, carry, outputs, step_batch(steps - 1)


def _compile(variant: Any, args: tuple, length: int, todo: list[int], started: float) -> None:
    """Compiles `variant` for `args` ahead of its first call (which then finds it in
    JAX's caches). A failure is left for that call to raise, where it belongs."""
    try:
        variant.lower(*args).compile()
    except Exception as error:  # noqa: BLE001 - the run that needs this program compiles it itself
        compile_log.debug("Compiling the step ahead for runs of %d steps failed: %r", length, error)
        return
    if length == todo[-1]:
        compile_log.info("Compiled the step ahead for runs of %s steps in %.2f s.", ", ".join(map(str, todo)),
                    time.perf_counter() - started)


def _evaluate(spec: Callable[..., Any], owner: object, state: Any, batch: Any, outputs: Mapping[str, Any]) -> Any:
    try:
        return spec(state, batch, outputs)
    except Exception as error:
        error.add_note(f"(in the fetch {spec!r} of {owner})")
        raise


def _is_array(value: Any) -> bool:
    return isinstance(value, (jax.Array, np.ndarray, np.generic, numbers.Number))


def _check_result(result: Any, state: Any) -> tuple[Any, dict[str, Any]]:
    """Checks (on trace) that the step returned `(new_state, {name: array})`."""
    if not (isinstance(result, tuple) and len(result) == 2):
        raise TypeError(
            f"step_fn must return a pair (new_state, outputs); it returned {_describe(result)}."
        )
    new_state, outputs = result
    if not _str_keys(outputs):
        raise TypeError(
            f"step_fn's outputs must be a dict of arrays such as {{'loss': loss}} (dicts may nest); "
            f"it returned {_describe(outputs)}."
        )
    bad = {k: _describe(v) for k, v in paths(outputs).items() if not _is_array(v)}
    if bad:
        raise TypeError(
            f"step_fn's outputs must be a dict of arrays such as {{'loss': loss}} (dicts may nest); "
            f"these entries are not arrays: {bad}. Return arrays (or scalars) only."
        )
    _check_same_state(state, new_state)
    return new_state, dict(outputs)


def _str_keys(outputs: Any) -> bool:
    """Whether `outputs` is a dict with str keys, and so is every dict in it."""
    return isinstance(outputs, Mapping) and all(
        isinstance(k, str) and (not isinstance(v, Mapping) or _str_keys(v)) for k, v in outputs.items())


def _check_same_state(state: Any, new_state: Any) -> None:
    old, new = jax.tree.structure(state), jax.tree.structure(new_state)
    if old != new:
        raise TypeError(
            "step_fn returned a new state with another structure than the state it was "
            f"given (given {old}, returned {new}). Return the same pytree with new values, "
            "e.g. state.replace(...) or state.apply_gradients(grads=...)."
        )
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(state), jax.tree.leaves(new_state), strict=True):
        before, after = (jnp.shape(a), jnp.result_type(a)), (jnp.shape(b), jnp.result_type(b))
        if before != after:
            raise TypeError(
                f"step_fn changed the shape or dtype of state{jax.tree_util.keystr(path)} "
                f"from {before} to {after}; every step would recompile. Keep each leaf's "
                "shape and dtype (cast with .astype if needed)."
            )


def _describe(value: Any) -> str:
    if isinstance(value, (jax.Array, np.ndarray)):
        return f"an array {_short(value)}"
    if isinstance(value, (tuple, list)):
        return f"{with_article(type(value).__name__)} of {len(value)}: ({', '.join(_short(v) for v in value)})"
    if isinstance(value, Mapping):
        return f"{with_article(type(value).__name__)} with keys {list(value)}"
    return f"{with_article(type(value).__name__)} ({value!r:.60})"


def _short(value: Any) -> str:
    if isinstance(value, (jax.Array, np.ndarray)):
        return f"{value.dtype}{list(value.shape)}"
    return type(value).__name__
