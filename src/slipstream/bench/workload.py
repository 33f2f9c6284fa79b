"""An A/B arm's workload as the ``TrainConfig`` ``slipstream train`` would run it (``train_config_of``).

Every slipstream arm builds the one step driver (``train/driver.py``) from this config: the run's
model, data, LoRA, optimizer and objective with the arm's own speedups and layout, so what the arm
times is what ``train`` runs; the documents every arm trains on are read by train's own reader
(``ab_samples``).
"""

from __future__ import annotations

import dataclasses

from ..train.config import OptimizerConfig, TrainConfig, TrainingConfig
from .arms import ARM_SPECS, arm_speedups, shares_prefixes
from .inputs import ABInputError


def train_config_of(config, arm: str) -> TrainConfig:
    """``slipstream train``'s config of ``arm``: the A/B's one train config (an ``ABConfig``'s) with the
    arm's own speedups and prefix sharing, run for the A/B's steps."""
    from ..objectives import objective_for

    spec, train = ARM_SPECS[arm], config.train
    replace = dataclasses.replace
    return replace(
        train,
        data=replace(
            train.data,
            # documents are read through the cache (as ``ab`` always read them); a reference pass is
            # computed in every arm's process, not read back, so its time is the arm's own
            cache=objective_for(train.training.objective).reads == "samples",
            share_prefixes=train.data.share_prefixes if shares_prefixes(arm) else "off",
            eval_path=None,  # a timed A/B trains; it does not evaluate
            eval_fraction=None,
        ),
        lora=replace(train.lora, dropout=0.0),  # each arm would draw its own masks: no dropout in an A/B
        # the peers' optimizer (AdamW at its default betas, clipped at 1.0, no weight decay) at the run's lr
        optimizer=replace(
            OptimizerConfig(),
            lr=train.optimizer.lr,
            schedule=train.optimizer.schedule,
            warmup_steps=train.optimizer.warmup_steps,
        ),
        training=TrainingConfig(
            objective=train.training.objective, steps=config.ab.steps, grad_accum=train.training.grad_accum
        ),
        preference=replace(train.preference, prefix_sharing=spec.pairs != "unshared"),
        grpo=replace(train.grpo, prefix_sharing=spec.prefixes != "unshared"),
        speedups=arm_speedups(config, arm),
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
