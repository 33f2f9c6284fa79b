"""The error a run raises about itself (not its config: that is ``fields.ConfigError``).

It sits below every layer because both sides of the run raise it: the objectives (a tokenizer that
cannot render the data, no row left to train on) and the training loop around them
(``slipstream.train.errors`` re-exports it beside ``TrainInterrupted``).
"""

from __future__ import annotations


class TrainError(RuntimeError):
    """A problem with the run itself (not the config): the message says what and where."""
