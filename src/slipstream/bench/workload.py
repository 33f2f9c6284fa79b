"""An A/B arm's workload as the ``TrainConfig`` ``slipstream train`` would run it (``train_config_of``).

Every slipstream arm builds the one step driver (``train/driver.py``) from this config: the run's
model, data, LoRA, optimizer and objective with the arm's own speedups and layout, so what the arm
times is what ``train`` runs; the documents every arm trains on are read by train's own reader
(``ab_samples``).
"""

from __future__ import annotations

import dataclasses

from ..train.config import (
    DataConfig,
    GRPOConfig,
    LoraConfig,
    ModelConfig,
    OptimizerConfig,
    PreferenceConfig,
    TrainConfig,
    TrainingConfig,
)
from .adapter import lora_alpha
from .arms import ARM_SPECS, arm_speedups, shares_prefixes
from .inputs import ABInputError, is_model_dir


def train_config_of(config, arm: str) -> TrainConfig:
    """``slipstream train``'s config of ``arm`` on the A/B workload ``config`` (an ``ABConfig``)."""
    from ..objectives import objective_for

    spec = ARM_SPECS[arm]
    directory = is_model_dir(config.model)
    reads = objective_for(config.objective).reads
    lora = LoraConfig(enabled=False)
    if config.lora_rank:
        lora = LoraConfig(
            rank=config.lora_rank,
            alpha=lora_alpha(config),
            dropout=0.0,  # each arm would draw its own masks: no dropout in an A/B
            target_modules=list(config.lora_targets),
            modules_to_save=list(config.lora_modules_to_save),
        )
    return TrainConfig(
        model=ModelConfig(
            path=config.model if directory else None,
            preset=None if directory else config.model,
            layers=config.layers,
            dtype=config.dtype,
        ),
        data=DataConfig(
            path=config.data,
            demo_rows=config.num_rows,
            response_only=config.response_only,
            max_seq_len=config.max_seq_len,
            overflow=config.overflow,
            # documents are read through the cache (as ``ab`` always read them); a reference pass is
            # computed in every arm's process, not read back, so its time is the arm's own
            cache=reads == "samples",
            share_prefixes=config.share_prefixes if shares_prefixes(arm) else "off",
            chat_template=config.chat_template,
        ),
        lora=lora,
        optimizer=OptimizerConfig(
            lr=config.lr,
            weight_decay=0.0,
            schedule=config.schedule,
            warmup_steps=config.lr_warmup_steps,
        ),
        training=TrainingConfig(objective=config.objective, steps=config.steps, grad_accum=config.grad_accum),
        preference=PreferenceConfig(beta=config.beta, prefix_sharing=spec.pairs != "unshared"),
        grpo=dataclasses.replace(GRPOConfig(**config.grpo), prefix_sharing=spec.prefixes != "unshared"),
        speedups=arm_speedups(config, arm),
        seed=config.seed,
    )


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
