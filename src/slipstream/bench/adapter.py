"""The A/B run's LoRA adapter: one definition for every arm, slipstream's and the peers' alike.

Below both ``arms.py`` and ``peers/`` (each imports it), so neither imports the other for it.
"""

from __future__ import annotations

import torch

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")


def attach_lora(model, config):
    """The run's PEFT LoRA (rank ``config.lora_rank``, ``lora_alpha`` or 2r, no dropout, on
    ``lora_targets``, with ``lora_modules_to_save`` trained in full), initialised from ``config.seed``:
    the same adapter in every arm, peers included. Rank 0: the model as is.

    No dropout: each arm would draw its own masks, and loss curves could not be compared."""
    if not config.lora_rank:
        return model
    from peft import LoraConfig, get_peft_model  # heavy: only LoRA runs import it

    torch.manual_seed(config.seed)  # the same adapter initialisation in every arm
    lora = LoraConfig(
        r=config.lora_rank,
        lora_alpha=lora_alpha(config),
        target_modules=list(config.lora_targets),
        modules_to_save=list(config.lora_modules_to_save) or None,
    )
    return get_peft_model(model, lora)


def lora_alpha(config) -> float:
    """The A/B's LoRA alpha: as set, else twice the rank."""
    return config.lora_alpha if config.lora_alpha is not None else 2.0 * config.lora_rank
