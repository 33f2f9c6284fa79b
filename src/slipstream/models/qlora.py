"""Loading a local model for QLoRA: 4-bit linear layers and, for MoE models, 4-bit experts."""

from __future__ import annotations

import os

import torch

from ..moe.experts import experts_modules
from ..moe.nf4 import quantize_experts


def load_for_qlora(
    path: str | os.PathLike,
    double_quant: bool = False,
    compute_dtype: torch.dtype | None = None,
    trust_remote_code: bool = False,
    **kwargs,
) -> torch.nn.Module:
    """Load a ``save_pretrained`` directory with every weight that can be in NF4, in NF4.

    Linear layers go through bitsandbytes' 4-bit loading; that leaves MoE expert weights (3D
    parameters, most of an MoE's memory) in full precision, so they are then quantized by
    ``slipstream.moe.nf4.quantize_experts`` and sorted routing is switched on. Nothing is
    fetched from a hub (``local_files_only``).
    """
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    if compute_dtype is None:
        compute_dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float32
    quantization = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=double_quant,
        bnb_4bit_compute_dtype=compute_dtype,
    )
    model = AutoModelForCausalLM.from_pretrained(
        path,
        quantization_config=quantization,
        local_files_only=True,
        trust_remote_code=trust_remote_code,
        dtype=compute_dtype,
        **kwargs,
    )
    if experts_modules(model):
        quantize_experts(  # also switches the experts to sorted routing, which runs NF4 experts
            model, double_quant=double_quant, compute_dtype=str(compute_dtype).removeprefix("torch.")
        )
    for param in model.parameters():
        param.requires_grad_(False)
    return model
