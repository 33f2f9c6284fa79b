"""The A/B arms: what each one changes, and the model and batches it trains with.

- ``stock-padded``: stock transformers (sdpa), one right-padded row per document.
- ``stock-packed``: stock transformers (sdpa), the packed row with restarting position_ids
  (transformers detects packing and builds a dense [1, 1, T, T] mask).
- ``slipstream``: ``slipstream.optimize`` and the PackedBatch.
"""

from __future__ import annotations

import torch

from .. import speedups as speedups_module  # read at call time, so a new field is known here
from ..data.labels import count_label_tokens
from ..models import build_model
from ..optimize import optimize, state_of
from ..packing import collate_packed, collate_padded

# Each arm: the batch layout, the toggles it runs with and its loss ("stock": transformers'
# full logits; "chunked": slipstream's chunked LM head + loss; "trl-fused": TRL 1.16's fused LM
# head, as its SFTTrainer computes the loss). Stock arms are the model as users run it today
# (transformers' own attention and experts); "trl-fused-head" is the peer users would pick for
# memory; "slipstream-no-*" are leave-one-out ablations, so every optimization's share shows.
_SLIPSTREAM = {
    "layout": "packed",
    "packed_attention": True,
    "moe_routing": None,
    "stock": False,
    "loss": "chunked",
}
ARM_SPECS: dict[str, dict] = {
    "stock-padded": {
        "layout": "padded",
        "packed_attention": False,
        "moe_routing": "stock",
        "stock": True,
        "loss": "stock",
    },
    "stock-packed": {
        "layout": "packed",
        "packed_attention": False,
        "moe_routing": "stock",
        "stock": True,
        "loss": "stock",
    },
    "trl-fused-head": {
        "layout": "packed",
        "packed_attention": False,
        "moe_routing": "stock",
        "stock": True,
        "loss": "trl-fused",
    },
    "slipstream": _SLIPSTREAM,
    "slipstream-offload": {**_SLIPSTREAM, "checkpointing": "auto"},
    "slipstream-no-packed-attention": {**_SLIPSTREAM, "packed_attention": False},
    "slipstream-no-moe-routing": {**_SLIPSTREAM, "moe_routing": "stock"},
    "slipstream-no-offload": {**_SLIPSTREAM, "checkpointing": "recompute"},
    "slipstream-no-chunked-loss": {**_SLIPSTREAM, "loss": "stock"},
}
ARMS = tuple(ARM_SPECS)
ARM_PRESETS = {
    "default": ("stock-padded", "stock-packed", "slipstream"),
    "ablation": (
        "stock-packed",
        "slipstream",
        "slipstream-no-packed-attention",
        "slipstream-no-moe-routing",
        "slipstream-no-chunked-loss",
    ),
    # --max-tokens-within: the memory ceiling of stock, TRL's fused head and slipstream (+ offload)
    "ceiling": ("stock-packed", "trl-fused-head", "slipstream", "slipstream-offload"),
}


def micro_batch_inputs(arm: str, docs: list[dict], device: str):
    """The model kwargs of one micro-batch in ``arm``'s layout, and its label-token count."""
    spec = ARM_SPECS[arm]
    if spec["layout"] == "padded":
        inputs = {k: (v.to(device) if hasattr(v, "to") else v) for k, v in collate_padded(docs).items()}
        return inputs, count_label_tokens(docs)  # the same count the packed layouts carry
    batch = collate_packed(docs, device=device)
    inputs = batch.model_inputs() if spec["packed_attention"] else batch.stock_inputs()
    if spec["loss"] == "trl-fused":
        inputs["fused_lm_head"] = True  # TRL's fused LM head computes the loss (see build_arm_model)
    return inputs, batch.num_label_tokens


def arm_speedups(config, arm: str, checkpointing: str):
    """What an arm runs: its own settings over the config's speedup options (slipstream arms only)."""
    spec = ARM_SPECS[arm]
    own = {
        "packed_attention": spec["packed_attention"],
        "moe_routing": spec["moe_routing"],
        "checkpointing": checkpointing,
        "chunked_loss": None if spec["loss"] == "chunked" else False,
    }
    # An option sets a field the arm leaves at its default; the field an arm ablates stays its own.
    default = speedups_module.Speedups()
    options = {
        key: value
        for key, value in config.speedups.items()
        if not spec["stock"] and (key not in own or own[key] == getattr(default, key))
    }
    return speedups_module.Speedups(**{**own, **options})


def build_arm_model(config, arm: str, vocab_size: int, device: str):
    """The model an arm trains, set up as the arm says; returns ``(model, slipstream state)``.

    Every arm starts from the same weights (``config.seed``) and, with ``lora_rank``, the same
    adapter initialisation.
    """
    if config.threads:
        torch.set_num_threads(config.threads)
    dtype = getattr(torch, config.dtype)
    model = build_model(
        config.model, vocab_size=vocab_size, layers=config.layers, seed=config.seed, dtype=dtype
    )
    model.to(device).train()
    spec = ARM_SPECS[arm]
    checkpointing = spec.get("checkpointing", config.checkpointing)
    if spec["stock"] and checkpointing != "off":
        checkpointing = "recompute"  # what stock transformers offers
    optimize(model, arm_speedups(config, arm, checkpointing))
    state = state_of(model)
    if spec["loss"] == "trl-fused":
        # TRL is optional and heavy: only this arm imports it
        from trl.trainer.utils import add_fused_lm_head  # what SFTTrainer 1.16 installs (before PEFT)

        add_fused_lm_head(model)
        state.policies.append("loss: TRL's fused LM head (trl.trainer.utils.add_fused_lm_head)")
    if config.lora_rank:
        from peft import LoraConfig, get_peft_model  # heavy: only LoRA runs import it

        torch.manual_seed(config.seed)  # the same adapter initialisation in every arm
        model = get_peft_model(
            model,
            LoraConfig(
                r=config.lora_rank,
                lora_alpha=2 * config.lora_rank,
                target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
            ),
        )
    return model, state
