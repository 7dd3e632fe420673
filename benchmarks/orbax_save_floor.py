"""What one Orbax checkpoint save costs when the state is tiny: the floor under every
checkpoint of a small model, whatever the saving loop does.

The state is the small MLP's (parameters and Adam moments, 33 KB). Each setting saves
it --saves times (after 3 untimed saves) through an `ocp.CheckpointManager`, waiting
for each save to finish; it reports the CPU time of the process per save (every
thread's, which is what a loop on a few cores loses), the wall time per save, and the
time the save call itself blocks. Settings: jaxmon's (`jaxmon._checkpoints.manager`'s options:
async, pinned host copy, no compression, a `meta` JSON item, LatestN(5)), then each
option changed alone, then all the savings together.

Run: .venv/bin/python benchmarks/orbax_save_floor.py [--saves 15]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import jax
import orbax.checkpoint as ocp
from core_overhead import make_workload


def manager(meta=True, keep=5, ocdbt=True, asynchronous=True, root_metadata=True, pinned=True,
            background_delete=False) -> ocp.CheckpointManager:
    handlers = {"state": ocp.PyTreeCheckpointHandler(enable_pinned_host_transfer=pinned, use_compression=False,
                                                     use_ocdbt=ocdbt)}
    if meta:
        handlers["meta"] = ocp.JsonCheckpointHandler()
    options = ocp.CheckpointManagerOptions(enable_async_checkpointing=asynchronous, max_to_keep=keep,
                                           save_root_metadata=root_metadata, create=True,
                                           enable_background_delete=background_delete)
    return ocp.CheckpointManager(tempfile.mkdtemp(), options=options, item_handlers=handlers)


def measure(state, saves: int, **settings) -> dict[str, float]:
    mgr = manager(**settings)

    def save(step: int) -> None:
        items = {"state": ocp.args.PyTreeSave(state)}
        if settings.get("meta", True):
            items["meta"] = ocp.args.JsonSave({"step": step})
        mgr.save(step, args=ocp.args.Composite(**items), force=True)

    for step in range(3):
        save(step)
        mgr.wait_until_finished()
    calls = []
    cpu, wall = time.process_time(), time.perf_counter()
    for step in range(3, 3 + saves):
        start = time.perf_counter()
        save(step)
        calls.append(time.perf_counter() - start)
        mgr.wait_until_finished()
    result = {"cpu_ms_per_save": (time.process_time() - cpu) / saves * 1e3,
              "wall_ms_per_save": (time.perf_counter() - wall) / saves * 1e3,
              "call_ms": statistics.median(calls) * 1e3}
    mgr.close()
    return {k: round(v, 1) for k, v in result.items()}


SETTINGS = {
    "jaxmon's options": {},
    "synchronous": {"asynchronous": False},
    "no max_to_keep (nothing deleted)": {"keep": None},
    "deleting in the background": {"background_delete": True},
    "no meta item": {"meta": False},
    "no OCDBT": {"ocdbt": False},
    "no root metadata": {"root_metadata": False},
    "no pinned host copy": {"pinned": False},
    "no deletes, no meta, no root metadata": {"keep": None, "meta": False, "root_metadata": False},
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--saves", type=int, default=15)
    args = parser.parse_args()
    init_fn, _, _ = make_workload()
    state = init_fn()
    nbytes = sum(leaf.nbytes for leaf in jax.tree.leaves(state))
    print(json.dumps({"state_bytes": nbytes, "saves": args.saves, "orbax-checkpoint": ocp.__version__,
                      "settings": {name: measure(state, args.saves, **kw) for name, kw in SETTINGS.items()}},
                     indent=2))


if __name__ == "__main__":
    main()
