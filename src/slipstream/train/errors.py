"""The errors ``slipstream train`` raises about the run itself (the config has ``ConfigError``)."""

from __future__ import annotations


class TrainError(RuntimeError):
    """A problem with the run itself (not the config): the message says what and where."""


class TrainInterrupted(TrainError, KeyboardInterrupt):
    """Ctrl-C / SIGINT / SIGTERM stopped the run; the message says what was saved and how to go on.

    Also a ``KeyboardInterrupt``, so code that lets Ctrl-C through keeps doing so, and a
    ``TrainError``, so the CLI prints its one line and exits non-zero.
    """
