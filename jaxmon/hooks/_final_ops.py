"""FinalOpsHook: fetches computed once, at the end, on the last run."""

from __future__ import annotations

import logging
from typing import Any

from jaxmon._base import fetches as _fetches
from jaxmon._base.hook import Hook, RunContext, RunValues

logger = logging.getLogger("jaxmon")


class FinalOpsHook(Hook):
    """Computes fetches once at `end`, on the last run's state, batch and outputs.

    Args:
      final_fetches: as `RunArgs.fetches` (output names or callables).

    Example:
      >>> import jaxmon as jm
      >>> hook = jm.FinalOpsHook({"norm": lambda state, batch, outputs: (state ** 2).sum()})
    """

    def __init__(self, final_fetches: Any):
        if not _fetches.normalize(final_fetches, "FinalOpsHook final_fetches"):
            raise ValueError("FinalOpsHook needs final_fetches: an output name, a list of names, or a dict.")
        self.final_fetches = final_fetches
        self._final_values: dict[str, Any] | None = None
        self._ran = False

    @property
    def final_values(self) -> dict[str, Any] | None:
        """The fetched values as host NumPy after `end`; None before (or if no step ran)."""
        return self._final_values

    final_ops_values = final_values

    def begin(self) -> None:
        self._final_values, self._ran = None, False

    def after_run(self, ctx: RunContext, values: RunValues) -> None:
        self._ran = True

    def end(self, session) -> None:
        if not self._ran:
            logger.warning("FinalOpsHook: no step ran in this session, so there is nothing to fetch; "
                           "final_values stays None.")
            return
        self._final_values = session.fetch(self.final_fetches)

    def __repr__(self) -> str:
        return f"FinalOpsHook({self.final_fetches!r})"
