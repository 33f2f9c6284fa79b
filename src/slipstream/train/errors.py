"""The errors ``slipstream train`` raises about the run itself (the config has ``ConfigError``).

``TrainError`` lives in :mod:`slipstream.errors` (the objectives below the loop raise it too) and is
re-exported here, where users and the CLI catch it.
"""

from __future__ import annotations

from ..errors import TrainError

__all__ = ["TrainError", "TrainInterrupted"]


class TrainInterrupted(TrainError, KeyboardInterrupt):
    """Ctrl-C / SIGINT / SIGTERM stopped the run; the message says what was saved and how to go on.

    Also a ``KeyboardInterrupt``, so code that lets Ctrl-C through keeps doing so, and a
    ``TrainError``, so the CLI prints its one line and exits non-zero.
    """
