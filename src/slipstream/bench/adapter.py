"""The A/B run's LoRA adapter: one definition for every arm, slipstream's and the peers' alike.

Below both ``arms.py`` and ``peers/`` (each imports it), so neither imports the other for it.
"""

from __future__ import annotations

import torch

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")


def attach_lora(model, config):
    """The run's PEFT LoRA (rank ``config.lora_rank``, alpha 2r, no dropout, q/k/v/o), initialised
    from ``config.seed``: the same adapter in every arm, peers included. Rank 0: the model as is."""
    if not config.lora_rank:
        return model
    from peft import LoraConfig, get_peft_model  # heavy: only LoRA runs import it

    torch.manual_seed(config.seed)  # the same adapter initialisation in every arm
    lora = LoraConfig(r=config.lora_rank, lora_alpha=2 * config.lora_rank, target_modules=list(LORA_TARGETS))
    return get_peft_model(model, lora)
