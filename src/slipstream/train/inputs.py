"""What a step driver is built on besides its config (:class:`DriverInputs`): ``slipstream train``
reads them (:func:`read_inputs`); an A/B arm builds its own on the steps the A/B planned for every arm."""

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
    """The tokenizer, the objective, and its rows read (``data``: ``objective.read``'s bins and held-out
    set) or its steps planned (``plan``: each step's bins, ``[step][micro_batch] -> rows``)."""

    tokenizer: Any
    objective: Objective
    device: torch.device
    dtype: torch.dtype
    data: ObjectiveData | None = None
    plan: list[list[list[dict]]] | None = None
    vocab_size: int | None = None  # the embedding rows (None: the tokenizer's)


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
