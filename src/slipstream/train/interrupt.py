"""Ctrl-C while training: finish the step, save a checkpoint of it, stop with a one-line message.

Inside ``GracefulStop`` the first SIGINT (Ctrl-C) or SIGTERM (what torchrun forwards to its
workers, and what schedulers send before a preemption) only records the request; the loop
sees it after the step that is running completes, saves a checkpoint of that step and raises
``TrainInterrupted``. The state saved is therefore always a whole step's: a signal never lands
halfway through an optimizer update. A second signal does what it would have done without
us (Ctrl-C raises ``KeyboardInterrupt`` at once; SIGTERM ends the process).

Under torchrun every rank records its own signal; the ranks agree (``stop_agreed``, an
all-reduce per step) to stop after the same step, and only rank 0 writes.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading

from .distributed import Distributed

logger = logging.getLogger("slipstream")

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class GracefulStop:
    """From ``install`` to ``restore``: ``requested`` names the first signal received, else None."""

    def __init__(self) -> None:
        self.requested: str | None = None
        self._previous: dict[int, object] = {}

    def install(self) -> GracefulStop:
        if threading.current_thread() is threading.main_thread():  # signals reach the main thread only
            for sig in SIGNALS:
                with contextlib.suppress(ValueError, OSError):  # an embedding may not allow it
                    self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def restore(self) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
        self._previous = {}

    def _handle(self, signum, frame) -> None:
        self.requested = signal.Signals(signum).name
        self.restore()  # a second signal acts at once
        logger.warning(
            "%s received: stopping after this step to save a checkpoint (press Ctrl-C again to stop "
            "at once, without one)",
            self.requested,
        )


def stop_agreed(requested: str | None, info: Distributed) -> bool:
    """Whether any rank was asked to stop (every rank calls this after every step)."""
    if not info.enabled:
        return requested is not None
    return info.sum(1.0 if requested is not None else 0.0) > 0
