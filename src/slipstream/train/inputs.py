"""What a step driver is built on besides its config: the tokenizer, the objective and its steps' rows.

:func:`read_inputs` is ``slipstream train``'s: the tokenizer (with ``data.chat_template``'s template),
the objective ``training.objective`` names and its rows read and packed (``objective.read``), on the
device and dtype set-up chose. An A/B arm builds its :class:`DriverInputs` itself, on the rows the
A/B planned once for every arm (``plan``). ``driver.driver_for`` takes either.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from transformers import AutoTokenizer

from ..data import demo_tokenizer
from ..data.chat import read_chat_template
from ..objectives import Objective, ObjectiveData, objective_for
from .config import TrainConfig
from .distributed import Distributed
from .errors import TrainError
from .preflight import check_model_dir


@dataclass
class DriverInputs:
    """What a driver is built on besides its config, read once by its caller: the run's bins are
    ``data`` (``objective.read``: bins in ``data.steps``' order, the held-out set) or ``plan``
    (each step's bins in that order already, ``[step][micro_batch] -> rows``: an A/B arm's)."""

    tokenizer: Any
    objective: Objective
    device: torch.device
    dtype: torch.dtype
    data: ObjectiveData | None = None
    plan: list[list[list[dict]]] | None = None
    vocab_size: int | None = None  # the embedding rows (None: the tokenizer's)

    def __post_init__(self) -> None:
        if (self.data is None) == (self.plan is None):
            raise ValueError("DriverInputs: give exactly one of data (rows read) or plan (steps planned)")


def read_inputs(
    config: TrainConfig, info: Distributed, device: torch.device, dtype: torch.dtype
) -> DriverInputs:
    """``slipstream train``'s inputs: the tokenizer, the objective and its rows read and packed."""
    tokenizer = load_tokenizer(config)
    objective = objective_of(config)
    return DriverInputs(tokenizer, objective, device, dtype, data=objective.read(tokenizer, info))


def objective_of(config: TrainConfig) -> Objective:
    """The objective ``training.objective`` names (the config checked it is registered)."""
    return objective_for(config.training.objective)(config)


def load_tokenizer(config: TrainConfig):
    """The run's tokenizer: the preset's, or the one saved beside ``model.path``; ``data.chat_template``'s
    template in place of its own."""
    if config.model.preset is not None:
        return with_chat_template(demo_tokenizer(), config)
    # before anything reads it: a missing directory is not a network problem
    check_model_dir(config.model.path)
    try:
        tokenizer = AutoTokenizer.from_pretrained(
            config.model.path, local_files_only=True, trust_remote_code=config.model.trust_remote_code
        )
    except (OSError, ValueError) as error:
        raise TrainError(
            f"{config.model.path}: no usable tokenizer saved beside the model ({error})"
        ) from None
    return with_chat_template(tokenizer, config)  # data.chat_template: another template than the model's


def with_chat_template(tokenizer, config: TrainConfig):
    """The tokenizer with ``data.chat_template``'s template in place of its own (unset: as it is)."""
    if config.data.chat_template is None:
        return tokenizer
    try:
        tokenizer.chat_template = read_chat_template(config.data.chat_template)
    except ValueError as error:
        raise TrainError(f"data.chat_template {error}") from None
    return tokenizer
