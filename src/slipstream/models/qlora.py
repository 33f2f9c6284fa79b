"""Loading a local model for QLoRA: 4-bit linear layers and, for MoE models, 4-bit experts."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch

from ..moe.experts import experts_modules
from ..moe.nf4 import dequantize_experts, quantize_experts


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

    from ..extras import require

    require("bitsandbytes", "quantization.four_bit (QLoRA)")
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


def dequantize_model(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """Undo ``load_for_qlora`` in place: every 4-bit linear layer and 4-bit experts module back to
    dense weights in ``dtype``, holding the values the 4-bit forward computes with
    (bitsandbytes' ``dequantize_4bit``; ``moe.nf4.dequantize_experts``), and no trace of the
    quantization left in the model or its config. Returns the model."""
    from ..extras import require

    bnb = require("bitsandbytes", "merging a 4-bit (QLoRA) run")

    for name, module in list(model.named_modules()):
        if not isinstance(module, bnb.nn.Linear4bit):
            continue
        data, state = module.weight.data, module.weight.quant_state
        if getattr(state, "packing_format_for_cpu", False):  # repacked by an eval forward (see below)
            from bitsandbytes.nn.modules import _convert_weight_packed_for_cpu_inverse

            data, state = _convert_weight_packed_for_cpu_inverse(data, state)
        weight = bnb.functional.dequantize_4bit(data, state)
        dense = torch.nn.Linear(
            module.in_features,
            module.out_features,
            bias=module.bias is not None,
            device=weight.device,
            dtype=dtype,
        )
        with torch.no_grad():
            dense.weight.copy_(weight.to(dtype))
            if module.bias is not None:
                dense.bias.copy_(module.bias.to(dtype))
        dense.requires_grad_(False)
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, leaf, dense)
    dequantize_experts(model, dtype)
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    for attribute in ("hf_quantizer", "quantization_method"):
        if getattr(model, attribute, None) is not None:
            setattr(model, attribute, None)
    for attribute in ("is_loaded_in_4bit", "is_quantized"):
        if getattr(model, attribute, False) is True and not isinstance(
            getattr(type(model), attribute, None), property
        ):
            setattr(model, attribute, False)
    return model.to(dtype)


@contextlib.contextmanager
def training_4bit_forward(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """Run ``model``'s 4-bit linear layers as training ran them, in eval mode too.

    On a CPU with AVX512-BF16, bitsandbytes' eval-mode, no-grad forward repacks the weight for
    its gemv kernel, which rounds the activations to bf16 (relative error ~2e-3 against the
    dequantized weight in fp32); training (and any forward with gradients) multiplies by the
    dequantized weight in the compute dtype. Comparing a model against what a run trained wants
    the latter: this flags only the 4-bit layers as training (they hold no dropout) meanwhile.
    """
    try:
        import bitsandbytes as bnb
    except ImportError:  # no bitsandbytes, no 4-bit layer
        yield model
        return
    layers = [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit) and not m.training]
    for layer in layers:
        layer.training = True
    try:
        yield model
    finally:
        for layer in layers:
            layer.training = False
