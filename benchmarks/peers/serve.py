"""The loop of a peer worker: `benchmarks/suite.py` starts the worker with its
environment's Python, and asks it for one timing at a time, so that the peers take
their turn in the same rotation as jaxmon's variants.

Protocol (one JSON object per line): the worker first writes `{"versions": {...}}`;
then for each request `{"variant": name, "steps": n, "warmup": w}` on its stdin it
builds the variant afresh, runs `w` steps untimed and `n` timed, and writes
`{"us_per_step": t}` (or `{"error": message}`). It ends at the end of its stdin.
"""

from __future__ import annotations

import json
import sys
import traceback
from collections.abc import Callable
from typing import Any


def serve(measure: Callable[[str, int, int], float], versions: dict[str, Any]) -> None:
    """Answers the suite's requests with `measure(variant, steps, warmup)` (us per step)."""
    out = sys.stdout
    sys.stdout = sys.stderr  # whatever the library prints must not corrupt the protocol
    print(json.dumps({"versions": versions}), file=out, flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        try:
            answer = {"us_per_step": measure(request["variant"], request["steps"], request["warmup"])}
        except Exception as error:  # the suite reports it and skips the variant
            traceback.print_exc()
            answer = {"error": f"{type(error).__name__}: {error}"}
        print(json.dumps(answer), file=out, flush=True)
