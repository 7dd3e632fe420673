"""When the loop stops: the one stop decision (`Stopping`), and preemption (SIGTERM,
SIGHUP, Ctrl-C or JAX's preemption service) turned into a save and a stop."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from typing import Any

from jax.experimental import multihost_utils

from jaxmon._base import signals as _signals

logger = logging.getLogger("jaxmon")
_entered = False  # see session_entered()


def session_entered() -> bool:
    """Whether a session of this process has entered its `with` block (training started):
    the `jaxmon` command's line after a stop says so."""
    return _entered


class Stopping:
    """The session's stop decision: `run()` and `should_stop()` both ask it.

    A stop request (the caller's, a hook's, the end of data) decides at once with one
    JAX process; with several, it is carried to the next agreement point, where the
    agreement decides for every process (`agree`). A preemption (`preemption`) asks
    the loop to stop after one more run, which saves.

    Args:
      preemption: the session's `Preemption`.
      agreed: whether several processes agree on stops (see `agree.AgreedRuns`).
    """

    def __init__(self, preemption: Preemption, agreed: bool):
        self.preemption, self._agreed = preemption, agreed
        #: True once this process asked to stop.
        self.requested = False
        #: True once the stop is decided: no run may start.
        self.decided = False

    def request(self) -> None:
        self.requested = True
        self.decided = self.decided or not self._agreed

    def agree(self) -> None:
        """Every process stops here (an agreement found a stop or a failure)."""
        self.decided = True

    def rolled_back(self) -> None:
        """A roll-back restored an earlier step: a stop asked for at the steps it undid
        is forgotten (the hooks ask again when they get there); a preemption stays."""
        if not self.preemption.requested:
            self.requested = self.decided = False

    def after_run(self, step: int) -> None:
        """A preemption asks to stop after the run that completed `step` (several
        processes: once JAX's preemption service says every process reached it). The
        session calls it only while the preemption polls or was requested: otherwise
        there is nothing to look at."""
        if self.preemption.after_run(step):
            self.request()

    def should_stop(self) -> bool:
        return self.decided or self.preemption.requested


class Preemption:
    """Whether this run was asked to save at the next step boundary and stop.

    With one JAX process, SIGTERM and SIGHUP (a closed terminal or a dropped SSH
    session; both caught while the session is open) and SIGINT (Ctrl-C, caught inside
    the session's `with` block, from `catch_ctrl_c()` until `uninstall()`: a session
    left open elsewhere never swallows a Ctrl-C; in the `jaxmon` command, from the
    session's creation, as SIGTERM), in the main thread, call `request()`;
    a second one goes to the handler that was there before (by default: exit, or
    `KeyboardInterrupt` for Ctrl-C). After a Ctrl-C, `after_close` raises
    `KeyboardInterrupt` once the session has saved and closed. (A `KeyboardInterrupt`
    raised inside the `with` block saves too, then goes on; after a first Ctrl-C, it
    abandons the save.) With several processes, JAX's preemption service takes SIGTERM
    instead (SIGHUP is turned into a SIGTERM to this process for it), and
    `after_run(step)` asks it whether every process reached the step they agreed to
    stop at.

    Args:
      handle_sigterm: catch SIGTERM and SIGHUP, and SIGINT from `catch_ctrl_c()` (one
        process only).
      several_processes: poll JAX's preemption service after every run.
    """

    def __init__(self, *, handle_sigterm: bool, several_processes: bool):
        #: True once the request came from Ctrl-C.
        self.interrupted = False
        #: The signal that asked to save and stop (SIGTERM for `request_preemption()` and
        #: JAX's preemption service); None before.
        self.signal: signal.Signals | None = None
        #: When it was asked (`time.monotonic()`); None before.
        self.requested_at: float | None = None
        #: Whether `poll` asks JAX's preemption service (several processes, service on).
        self.polling = several_processes
        self._handlers: list[_SignalHandler] = []
        self._catching = handle_sigterm and not several_processes
        if self._catching:
            self._handlers = [_SignalHandler(signal.SIGTERM, self.request, lambda: self.requested),
                              _SignalHandler(signal.SIGHUP, self._hung_up, lambda: self.requested)]
            if _signals.in_the_command():  # the command's Ctrl-C saves from the start, as its SIGTERM does
                self._handlers.append(self._ctrl_c_handler())
        elif handle_sigterm and several_processes:  # JAX's service hears SIGTERM only
            self._handlers = [_SignalHandler(signal.SIGHUP, lambda: os.kill(os.getpid(), signal.SIGTERM),
                                             lambda: False)]

    def catch_ctrl_c(self) -> None:
        """Turns Ctrl-C into `request()` too, until `uninstall()` (the session's `with` block)."""
        global _entered
        _entered = True
        if self._catching and all(handler.signum != signal.SIGINT for handler in self._handlers):
            self._handlers.append(self._ctrl_c_handler())

    def _ctrl_c_handler(self) -> _SignalHandler:
        return _SignalHandler(signal.SIGINT, self._interrupt, lambda: self.requested)

    def request(self, by: str = "SIGTERM or request_preemption()", signum: signal.Signals = signal.SIGTERM) -> None:
        """Saves at the next step boundary, then stops (what SIGTERM does)."""
        if not self.requested:  # a launcher that said it for every process: its children at INFO
            logger.log(logging.INFO if _signals.launcher_says() else logging.WARNING,
                       "%s: saving at the next step boundary, then stopping; a second one stops at once.", by)
            self.signal, self.requested_at = signum, time.monotonic()

    @property
    def requested(self) -> bool:
        """Whether a signal (or a caller) asked to save at the next step boundary and stop."""
        return self.signal is not None

    def _hung_up(self) -> None:
        self.request("SIGHUP (the terminal closed)", signal.SIGHUP)

    def _interrupt(self) -> None:
        self.interrupted = not self.requested
        self.request("Ctrl-C", signal.SIGINT)

    def after_close(self, step: int) -> None:
        """Logs how long the stop took from its request; raises `KeyboardInterrupt` after a
        Ctrl-C, now that the session saved and closed."""
        if self.requested_at is not None:
            logger.info("Stopped at step %d, %.2f s after %s (the run under way, the save and the hooks' "
                           "close).", step, time.monotonic() - self.requested_at, _signals.NAMES[self.signal])
        if self.interrupted:
            self.interrupted = False
            raise KeyboardInterrupt(f"Stopped by Ctrl-C at step {step}")

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
        """Gives SIGTERM, SIGHUP and SIGINT back to the handlers that were there before."""
        for handler in self._handlers:
            handler.uninstall()


class _SignalHandler:
    """Calls `on_first()` on `signum`; once `requested()` holds, the signal goes to the
    handler that was there before."""

    def __init__(self, signum: signal.Signals, on_first, requested):
        self.signum, self._on_first, self._requested = signum, on_first, requested
        self._previous: Any = None
        self._installed = threading.current_thread() is threading.main_thread()
        if signum == signal.SIGHUP and self._installed and signal.getsignal(signum) is signal.SIG_IGN:
            self._installed = False  # under `nohup`: the run goes on when the terminal closes
        if self._installed:
            self._previous = signal.signal(signum, self._handle)
            if _signals.take_lost(signum):  # the command's, raised before and caught by a library
                self._handle(signum, None)
        elif signum == signal.SIGTERM:
            logger.info("The session is not in the main thread, so it does not handle SIGTERM, SIGHUP or Ctrl-C.")

    def _handle(self, signum, frame) -> None:
        if not self._requested():
            self._on_first()
            return
        self.uninstall()
        os.kill(os.getpid(), self.signum)

    def uninstall(self) -> None:
        if self._installed:
            self._installed = False
            signal.signal(self.signum, self._previous if self._previous is not None else signal.SIG_DFL)
