"""The documents every arm of an A/B trains on, read by ``slipstream train``'s own reader (``ab_samples``)
from the arm's ``TrainConfig`` (``arms.train_config_of``)."""

from __future__ import annotations

from .arms import train_config_of
from .inputs import ABInputError


def ab_samples(config, tokenizer) -> list[dict]:
    """The documents every arm trains on, read by ``slipstream train``'s own reader (the SFT objective's:
    the user's data file, or the built-in demo rows); ABInputError naming the file when it has no
    usable row."""
    from ..data import DataError
    from ..objectives.sft import SFT
    from ..train.errors import TrainError

    try:
        samples, _ = SFT(train_config_of(config, "slipstream")).samples(tokenizer)
    except (DataError, TrainError) as error:  # DataError names the file and line; TrainError the file
        raise ABInputError(str(error)) from None
    return samples
