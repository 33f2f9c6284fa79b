"""The A/B run's LoRA adapter: one definition for every arm, slipstream's and the peers' alike.

Below both ``arms.py`` and ``peers/`` (each imports it), so neither imports the other for it.
"""

from __future__ import annotations

import torch


def attach_lora(model, config):
    """The run's PEFT LoRA (the train config's ``lora`` section, without dropout), initialised from its seed:
    the same adapter in every arm, peers included. Rank 0: the model as is.

    No dropout: each arm would draw its own masks, and loss curves could not be compared."""
    if not config.lora_rank:
        return model
    from peft import LoraConfig, get_peft_model  # heavy: only LoRA runs import it

    torch.manual_seed(config.train.seed)  # the same adapter initialisation in every arm
    lora = LoraConfig(
        r=config.lora_rank,
        lora_alpha=config.train.lora.alpha,
        target_modules=list(config.train.lora.target_modules),
        modules_to_save=list(config.train.lora.modules_to_save) or None,
    )
    return get_peft_model(model, lora)
