"""What an Orbax checkpoint save of a ~100 MB train state costs a running training loop.

Workload: a jitted step with the state donated (``jax.jit(step, donate_argnums=0)``);
the state is a dict of 12 float32 arrays of 2048x1024 (params, first and second
moments of 4 matrices: 96 MiB, ~100.7 MB). Each step does a small matmul on a slice
of two matrices and an Adam-like elementwise update of every array, in place thanks
to the donation: a few ms per step on CPU (reported as ``normal_step_ms``).

Each configuration ("variant") is one ``save_fn(saver, step, state)``: the only code
that differs between variants. Variants: plain Orbax with its defaults, synchronous
and asynchronous (the reference), and jaxmon's checkpoint writer (the one
``CheckpointSaverHook`` saves through), synchronous and asynchronous, each also with
its integrity manifest off (``*_unchecked``: ``Checkpoints(integrity=False)``, no CRC-32
of the step's files written at the commit, so none checked at restore;
jaxmon/_checkpoints/integrity.py). A last measurement times sealing and checking one such
checkpoint alone (``integrity_median_ms``). A saver is whatever its factory
builds for a directory; the harness only needs ``is_saving_in_progress()``,
``wait_until_finished()`` and ``close()`` on it, plus the variant's ``restore_fn``.

Method, per round and per variant (variants interleaved in a rotating order, every
save into a fresh temporary directory, the saver built before the timing starts):
  1. run 8 steps, each timed with ``block_until_ready``; their median is this round's
     normal step time;
  2. copy the state to host (the reference values, untimed), then time
     ``save_fn(...)``, then keep stepping (each step timed with ``block_until_ready``)
     until ``saver.is_saving_in_progress()`` is false, then ``wait_until_finished()``;
  3. blocked = save() duration + max(0, first step after save - normal step);
     lost    = (time from the start of save() to the committed checkpoint, with the K
     steps run meanwhile) - K * normal step. For a synchronous save the step loop
     runs once, so lost ~= the save() duration, as it should;
  4. restore the checkpoint (after all those further donated steps; timed as
     ``restore_ms``, from the page cache, the integrity check included where it is on)
     and compare it bit-for-bit to the reference copy taken at save time: a save whose
     data the donated steps overwrote while it was in flight fails the run.
Medians over rounds; ratios are to the synchronous default-Orbax save's blocked time.

What an investigation of Orbax settings found (2 shared CPU cores, jax 0.10.2 CPU, orbax-checkpoint 0.12.8;
see the run's JSON for numbers, which move by +-20% between runs on this machine):
  - Default async save() returns in ~12 ms, but on CPU Orbax's device-to-host step is a
    zero-copy numpy view of the live buffers. JAX then cannot donate them to the next
    step and silently falls back to allocating and writing a fresh 100 MB state (page
    faults): the next step takes 50-150 ms instead of ~10. The saved data stays
    correct (no corruption: the restore check passes), it is just slow.
  - ``enable_pinned_host_transfer=True`` makes the transfer a real copy (device_put to
    the CPU's pinned_host memory) inside save(): save() costs ~+20 ms, but the next
    step is back to ~normal.
  - ``use_compression=False``: zstd on random-ish float32 buys nothing and is most of
    the background CPU; it roughly halves the training time lost.
  - use_zarr3 / use_ocdbt=False / create_directories_asynchronously=False / TensorStore
    concurrency 1 / a shorter GIL switch interval are all within noise of that pair.
    Background threads at nice 19 lower the time lost a little but double the time
    until the checkpoint is committed. The remaining ~15 ms of save() is Orbax
    starting ~10 Python threads per save (Thread.start waits for each under the GIL).
  - Numpy leaves are deep-copied by Orbax inside save() (fresh 100 MB): a host
    snapshot must be handed over as jax arrays (here: dlpack views of own buffers).

jaxmon's writer therefore uses ``PyTreeCheckpointHandler(enable_pinned_host_transfer=True,
use_compression=False)``.

Run: .venv/bin/python benchmarks/checkpoint_save.py --rounds 9
     (``--variants a,b`` runs a subset (sync_default always included),
     ``--list`` lists them, ``--per-round`` adds every round's numbers)
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from jaxmon._checkpoints import integrity as _integrity
from jaxmon._checkpoints import manager as _checkpoint

N_MATRICES = 4
SHAPE = (2048, 1024)  # 8 MiB per float32 array; x3 (param, mu, nu) x4 = 96 MiB
PRE_STEPS = 8
MAX_BACKGROUND_S = 30.0


# ----------------------------------------------------------------------------- workload
def make_state(seed: int = 0) -> dict:
    keys = jax.random.split(jax.random.PRNGKey(seed), N_MATRICES)
    params = {f"w{i}": jax.random.normal(k, SHAPE, jnp.float32) * 0.02 for i, k in enumerate(keys)}
    return {
        "params": params,
        "mu": {k: jnp.zeros(SHAPE, jnp.float32) for k in params},
        "nu": {k: jnp.zeros(SHAPE, jnp.float32) for k in params},
    }


def train_step(state: dict) -> dict:
    p, mu, nu = state["params"], state["mu"], state["nu"]
    h = jnp.tanh(p["w0"][:256, :256] @ p["w1"][:256, :256])  # a little real compute
    scale = 1e-3 * (1.0 + jnp.mean(h))
    new_p, new_mu, new_nu = {}, {}, {}
    for k in p:  # Adam-like elementwise update of every array (gradient proxy: scale*p)
        g = scale * p[k]
        new_mu[k] = 0.9 * mu[k] + 0.1 * g
        new_nu[k] = 0.999 * nu[k] + 0.001 * g * g
        new_p[k] = p[k] - 1e-3 * new_mu[k] / (jnp.sqrt(new_nu[k]) + 1e-8)
    return {"params": new_p, "mu": new_mu, "nu": new_nu}


step_jit = jax.jit(train_step, donate_argnums=0)


def state_nbytes(state) -> int:
    return sum(x.nbytes for x in jax.tree.leaves(state))


def meta_for(step: int) -> dict:
    return {"step": step, "note": "checkpoint_save benchmark"}


# ----------------------------------------------------------------------------- variants
@dataclasses.dataclass
class Variant:
    name: str
    make_saver: Callable[[str], Any]  # directory -> saver
    save_fn: Callable[[Any, int, Any], None]  # (saver, step, state) -> None; the timed part
    restore_fn: Callable[[Any, int], Any]  # (saver, step) -> pytree of arrays
    doc: str = ""


def _manager(directory: str, *, async_: bool, state_handler=None, async_options=None):
    kwargs = {}
    if state_handler is not None:
        kwargs["item_handlers"] = {"state": state_handler, "meta": ocp.JsonCheckpointHandler()}
    opts = {}
    if async_options is not None:
        opts["async_options"] = async_options
    return ocp.CheckpointManager(
        directory,
        options=ocp.CheckpointManagerOptions(
            enable_async_checkpointing=async_, max_to_keep=None, **opts),
        **kwargs,
    )


def save_standard(mgr: ocp.CheckpointManager, step: int, state) -> None:
    """Plain Orbax: StandardSave of the live (donated) jax arrays."""
    mgr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                           meta=ocp.args.JsonSave(meta_for(step))))


def save_pytree(mgr: ocp.CheckpointManager, step: int, state) -> None:
    """Same, through a PyTreeCheckpointHandler (whose options the variant chose)."""
    mgr.save(step, args=ocp.args.Composite(state=ocp.args.PyTreeSave(state),
                                           meta=ocp.args.JsonSave(meta_for(step))))


def restore_standard(mgr: ocp.CheckpointManager, step: int):
    return mgr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(),
                                                     meta=ocp.args.JsonRestore()))["state"]


def restore_pytree(mgr: ocp.CheckpointManager, step: int):
    return mgr.restore(step, args=ocp.args.Composite(state=ocp.args.PyTreeRestore(),
                                                     meta=ocp.args.JsonRestore()))["state"]


class JaxmonSaver:
    """jaxmon's own checkpoint writer (what CheckpointSaverHook saves through)."""

    def __init__(self, directory: str, async_save: bool, integrity: bool = True):
        self.checkpoints = _checkpoint.Checkpoints(directory, writer=True, async_save=async_save, max_to_keep=None,
                                                   integrity=integrity)

    def is_saving_in_progress(self) -> bool:
        return self.checkpoints._manager.is_saving_in_progress()

    def wait_until_finished(self) -> None:
        self.checkpoints.wait()

    def close(self) -> None:
        self.checkpoints.close()


def save_jaxmon(saver: JaxmonSaver, step: int, state) -> None:
    saver.checkpoints.save(step, state, meta_for(step))


def restore_jaxmon(saver: JaxmonSaver, step: int):
    return saver.checkpoints.restore(step, None).state


def build_variants() -> list[Variant]:
    return [
        Variant("sync_default", lambda d: _manager(d, async_=False), save_standard, restore_standard,
                "plain Orbax: enable_async_checkpointing=False, StandardSave, all defaults"),
        Variant("async_default", lambda d: _manager(d, async_=True), save_standard, restore_standard,
                "plain Orbax: enable_async_checkpointing=True, StandardSave, all defaults"),
        Variant("jaxmon_sync", lambda d: JaxmonSaver(d, async_save=False), save_jaxmon, restore_jaxmon,
                "jaxmon's Checkpoints(async_save=False): pinned host copy, no compression, blocking"),
        Variant("jaxmon_async", lambda d: JaxmonSaver(d, async_save=True), save_jaxmon, restore_jaxmon,
                "jaxmon's Checkpoints (CheckpointSaverHook's default): pinned host copy, no compression"),
        Variant("jaxmon_sync_unchecked", lambda d: JaxmonSaver(d, async_save=False, integrity=False), save_jaxmon,
                restore_jaxmon, "jaxmon_sync without the integrity manifest (none written, none checked)"),
        Variant("jaxmon_async_unchecked", lambda d: JaxmonSaver(d, async_save=True, integrity=False), save_jaxmon,
                restore_jaxmon, "jaxmon_async without the integrity manifest (none written, none checked)"),
    ]


# ----------------------------------------------------------------------------- harness
def timed_step(state):
    t = time.perf_counter()
    state = step_jit(state)
    jax.block_until_ready(state)
    return state, time.perf_counter() - t


def host_copy(state):
    return jax.tree.map(lambda x: np.array(x, copy=True), state)


def trees_equal(a, b) -> bool:
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    return len(la) == len(lb) and all(
        np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(la, lb, strict=True))


def measure_once(variant: Variant, state, step_no: int, verify: bool):
    root = tempfile.mkdtemp(prefix="ckpt_bench_")
    saver = variant.make_saver(os.path.join(root, "ckpt"))
    try:
        pre = []
        for _ in range(PRE_STEPS):
            state, dt = timed_step(state)
            pre.append(dt)
        normal = statistics.median(pre)
        ref = host_copy(state) if verify else None

        t0 = time.perf_counter()
        variant.save_fn(saver, step_no, state)
        t1 = time.perf_counter()
        steps = []
        while True:
            state, dt = timed_step(state)
            steps.append(dt)
            if not saver.is_saving_in_progress() or time.perf_counter() - t0 > MAX_BACKGROUND_S:
                break
        saver.wait_until_finished()
        t_end = time.perf_counter()

        save_call = t1 - t0
        blocked = save_call + max(0.0, steps[0] - normal)
        lost = (t_end - t0) - len(steps) * normal
        ok = restore_s = None
        if verify:
            t_restore = time.perf_counter()
            restored = jax.block_until_ready(variant.restore_fn(saver, step_no))
            restore_s = time.perf_counter() - t_restore
            ok = trees_equal(restored, ref)
        return state, {
            "normal_ms": normal * 1e3, "save_call_ms": save_call * 1e3,
            "next_step_ms": steps[0] * 1e3, "blocked_ms": blocked * 1e3,
            "lost_ms": lost * 1e3, "window_ms": (t_end - t0) * 1e3,
            "steps_in_window": len(steps), "restore_ok": ok,
            "restore_ms": None if restore_s is None else restore_s * 1e3,
        }
    finally:
        saver.close()
        shutil.rmtree(root, ignore_errors=True)


def time_integrity(state, step_no: int, rounds: int) -> dict:
    """Medians of sealing (writing the manifest) and checking one jaxmon checkpoint of
    `state`, its files in the page cache, apart from any training: the CPU cost that
    the save's commit and each restore pay."""
    root = tempfile.mkdtemp(prefix="ckpt_bench_")
    checkpoints = _checkpoint.Checkpoints(os.path.join(root, "ckpt"), writer=True, async_save=False)
    try:
        checkpoints.save(step_no, state, meta_for(step_no))
        step_directory = os.path.join(checkpoints.directory, str(step_no))
        seal, check = [], []
        for _ in range(rounds):
            t = time.perf_counter()
            _integrity.seal(step_directory)
            seal.append(time.perf_counter() - t)
            t = time.perf_counter()
            _integrity.check(step_directory)
            check.append(time.perf_counter() - t)
        sealed = sum(os.path.getsize(os.path.join(step_directory, name)) for name in _integrity._files(step_directory))
        return {"sealed_mb": round(sealed / 1e6, 1), "seal_ms": round(statistics.median(seal) * 1e3, 1),
                "check_ms": round(statistics.median(check) * 1e3, 1)}
    finally:
        checkpoints.close()
        shutil.rmtree(root, ignore_errors=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--variants", default="", help="comma-separated subset (default: all)")
    ap.add_argument("--list", action="store_true")
    ap.add_argument("--no-verify", action="store_true", help="skip restore-and-compare")
    ap.add_argument("--per-round", action="store_true", help="also print every round's numbers")
    args = ap.parse_args(argv)

    with contextlib.suppress(Exception):
        from absl import logging as absl_logging
        absl_logging.set_verbosity(absl_logging.WARNING)

    variants = build_variants()
    if args.list:
        for v in variants:
            print(f"{v.name}: {v.doc}")
        return 0
    if args.variants:
        wanted = args.variants.split(",")
        variants = [v for v in variants if v.name in wanted or v.name == "sync_default"]
    names = [v.name for v in variants]

    state = make_state()
    state = step_jit(state)  # compile
    jax.block_until_ready(state)
    step_no = 1
    # Warm-up: one untimed save per variant (Orbax code paths, buffers, thread pools).
    for v in variants:
        state, r = measure_once(v, state, step_no, verify=True)
        step_no += 1
        if not r["restore_ok"]:
            print(f"warm-up save of {v.name} restored wrong values", file=sys.stderr)

    per = {n: [] for n in names}
    t_start = time.perf_counter()
    for rnd in range(args.rounds):
        order = names[rnd % len(names):] + names[:rnd % len(names)]
        for n in order:
            v = variants[names.index(n)]
            state, r = measure_once(v, state, step_no, verify=not args.no_verify)
            step_no += 1
            per[n].append(r)

    med = lambda n, key: statistics.median(r[key] for r in per[n])  # noqa: E731
    sync_blocked = med("sync_default", "blocked_ms") if "sync_default" in per else float("nan")
    results = {}
    for n in names:
        row = {key: round(med(n, key), 1) for key in (
            "normal_ms", "save_call_ms", "next_step_ms", "blocked_ms", "lost_ms", "window_ms")}
        row["steps_in_window"] = med(n, "steps_in_window")
        row["blocked_vs_sync"] = round(row["blocked_ms"] / sync_blocked, 3)
        row["lost_vs_sync"] = round(row["lost_ms"] / sync_blocked, 3)
        if not args.no_verify:
            row["restore_ms"] = round(med(n, "restore_ms"), 1)
        oks = [r["restore_ok"] for r in per[n] if r["restore_ok"] is not None]
        row["restore_exact"] = f"{sum(oks)}/{len(oks)}"
        if args.per_round:
            row["rounds"] = [{k: (round(x, 1) if isinstance(x, float) else x) for k, x in r.items()}
                             for r in per[n]]
        results[n] = row

    out = {
        "benchmark": "checkpoint_save",
        "machine": f"{os.cpu_count()} CPU cores, {platform.machine()}, jax {jax.__version__} "
                   f"({jax.default_backend()}), orbax-checkpoint {ocp.__version__}",
        "state_mb": round(state_nbytes(state) / 1e6, 1),
        "rounds": args.rounds,
        "elapsed_s": round(time.perf_counter() - t_start, 1),
        "targets": {"async_blocked_vs_sync": 0.2, "async_lost_vs_sync": 0.5},
        "results_median_ms": results,
        "integrity_median_ms": time_integrity(state, step_no, args.rounds),
    }
    print(json.dumps(out, indent=2))
    bad = [n for n in names if results[n]["restore_exact"].split("/")[0] != results[n]["restore_exact"].split("/")[1]]
    if bad:
        print(f"RESTORE MISMATCH in {bad}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
