"""PEFT LoRA layers computed in the activations' dtype: no casts of activations per call.

PEFT keeps adapters in fp32 over a bf16 base (``autocast_adapter_dtype``) and, at every LoRA
linear, casts the [tokens, in] input to fp32, runs A and B in fp32, scales, adds the bf16 base
output (promoting it to fp32) and casts the sum back: three activation-sized copies and two
elementwise passes per wrapped linear, forward and again in backward. Here the fp32 adapter
weights stay what the optimizer updates (the master copy, saved in PEFT's format as before); each
call casts only them (r x in and out x r: tiny) to the activations' dtype, and the update lands
in one GEMM that also adds the base output:

    out = addmm(base(x), (dropout(x) @ A^T), B^T, alpha=scaling)     # one rounding, fp32 accumulate

so the activations never change dtype. The gradients of A and B come back through the weight
casts in fp32 (the GEMMs that make them accumulate in fp32 and round once to the compute dtype:
the same rounding every bf16 weight gradient has). A layer this path cannot run exactly as PEFT
does (merged, several or no active adapters, DoRA and other variants, a LoRA bias, mixed-batch
``adapter_names``, a base that is not a plain ``nn.Linear``) keeps PEFT's own forward.
"""

from __future__ import annotations

import sys
import types
from typing import Any

import torch
import torch.nn.functional as F

_ATTR = "_slipstream_lora_compute"


def _peft_linear_class():
    """PEFT's LoRA Linear, or None when PEFT was never imported: then no model holds one, and
    importing it here (inside a forward, maybe under a fake CUDA device) would only cost time."""
    if "peft" not in sys.modules:
        return None
    try:
        from peft.tuners.lora.layer import Linear
    except ImportError:  # a broken PEFT install: nothing to adapt
        return None
    return Linear


def eligible(module: torch.nn.Module) -> str | None:
    """Why ``module`` (a PEFT LoRA Linear) keeps PEFT's forward, or None if this path runs it exactly."""
    if type(module.base_layer) is not torch.nn.Linear:
        return f"its base is {type(module.base_layer).__name__}, not nn.Linear"
    if getattr(module, "lora_variant", None):
        return "a LoRA variant (DoRA, ...)"
    if any(getattr(b, "bias", None) is not None for b in module.lora_B.values()):
        return "a LoRA bias"
    return None


def _forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """One active vanilla adapter, not merged: base + scaling * B(A(dropout(x))) in x's dtype."""
    active = [name for name in self.active_adapters if name in self.lora_A]
    if args or kwargs or self.disable_adapters or self.merged or len(active) != 1:
        return type(self).forward(self, x, *args, **kwargs)  # PEFT's own, for everything else
    name = active[0]
    result = self.base_layer(x)
    dtype = result.dtype
    a = self.lora_A[name].weight.to(dtype)
    b = self.lora_B[name].weight.to(dtype)
    hidden = F.linear(self.lora_dropout[name](x.to(dtype)), a)
    flat = torch.addmm(
        result.reshape(-1, result.shape[-1]),
        hidden.reshape(-1, hidden.shape[-1]),
        b.t(),
        alpha=self.scaling[name],
    )
    return flat.view(result.shape)


def install(model: torch.nn.Module) -> tuple[int, dict[str, int]]:
    """Give every eligible PEFT LoRA Linear of ``model`` this forward; (installed, {reason: count kept})."""
    linear = _peft_linear_class()
    installed, kept = 0, {}
    if linear is None:
        return 0, kept
    for module in model.modules():
        if not isinstance(module, linear) or getattr(module, _ATTR, False):
            continue
        reason = eligible(module)
        if reason:
            kept[reason] = kept.get(reason, 0) + 1
            continue
        module.forward = types.MethodType(_forward, module)
        setattr(module, _ATTR, True)
        installed += 1
    return installed, kept


def uninstall(model: torch.nn.Module) -> int:
    """PEFT's own forward back on every layer ``install`` changed; how many."""
    count = 0
    for module in model.modules():
        if getattr(module, _ATTR, False):
            del module.forward  # the instance attribute: the class's (PEFT's) forward again
            delattr(module, _ATTR)
            count += 1
    return count
