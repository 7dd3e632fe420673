"""Preemption: SIGTERM, or JAX's preemption service, turned into a save and a stop."""

from __future__ import annotations

import logging
import os
import signal
import threading
from typing import Any

from jax.experimental import multihost_utils

logger = logging.getLogger("jaxmon")


class Preemption:
    """Whether this run was asked to save at the next step boundary and stop.

    With one JAX process, SIGTERM (caught while the session is open, if it was built
    in the main thread) calls `request()`; a second SIGTERM goes to the handler that
    was there before (by default: exit). With several processes, JAX's preemption
    service takes SIGTERM instead, and `after_run(step)` asks it whether every process
    reached the step they agreed to stop at.

    Args:
      handle_sigterm: catch SIGTERM (one process only).
      several_processes: poll JAX's preemption service after every run.
    """

    def __init__(self, *, handle_sigterm: bool, several_processes: bool):
        self.requested = False
        #: Whether `poll` asks JAX's preemption service (several processes, service on).
        self.polling = several_processes
        self._sigterm = None
        if handle_sigterm and not several_processes:
            self._sigterm = _SigtermHandler(on_first=self.request, requested=lambda: self.requested)

    def request(self) -> None:
        """Saves at the next step boundary, then stops (what SIGTERM does)."""
        if not self.requested:
            logger.warning("Preemption (SIGTERM or request_preemption()): saving at the next step boundary, then "
                           "stopping; a second SIGTERM exits at once.")
        self.requested = True

    def after_run(self, step: int) -> bool:
        """Whether to save and stop after the run that completed `step`; with several
        processes, JAX's preemption service is asked whether every process reached the
        step to stop at."""
        if self.polling:
            try:
                if multihost_utils.reached_preemption_sync_point(step):
                    self.request()
            except RuntimeError as error:  # the service is off: nothing to poll
                logger.warning("Not polling JAX's preemption sync point: %s", error)
                self.polling = False
        return self.requested

    def uninstall(self) -> None:
        """Gives SIGTERM back to the handler that was there before."""
        if self._sigterm is not None:
            self._sigterm.uninstall()


class _SigtermHandler:
    """Calls `on_first()` on SIGTERM; once `requested()` holds, a SIGTERM goes to the
    handler that was there before."""

    def __init__(self, on_first, requested):
        self._on_first, self._requested = on_first, requested
        self._previous: Any = None
        self._installed = threading.current_thread() is threading.main_thread()
        if self._installed:
            self._previous = signal.signal(signal.SIGTERM, self._handle)
        else:
            logger.info("The session is not in the main thread, so it does not handle SIGTERM.")

    def _handle(self, signum, frame) -> None:
        if not self._requested():
            self._on_first()
            return
        self.uninstall()
        os.kill(os.getpid(), signal.SIGTERM)

    def uninstall(self) -> None:
        if self._installed:
            self._installed = False
            signal.signal(signal.SIGTERM, self._previous if self._previous is not None else signal.SIG_DFL)
