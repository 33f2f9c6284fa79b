"""LoRA on expert projections: a per-expert A/B pair, applied inside the sorted routing.

PEFT's parameter targeting wraps a 3D expert weight as ``W + B @ A`` materialised for every
expert on every forward, and it cannot target 4-bit experts (they are buffers, not
parameters). This adapter instead runs ``x_e @ A_e @ B_e`` on each expert's own slice of
rows through the same grouped compute as the base weight, so its cost follows the tokens,
and it works the same over full-precision and 4-bit experts. B starts at zero, so adding
the adapter does not change the model. ``save_expert_lora`` / ``load_expert_lora`` export
the adapters alone (safetensors + a JSON config).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ..atomic import atomic_file
from .experts import experts_modules

CONFIG_FILE = "expert_lora_config.json"
WEIGHTS_FILE = "expert_lora.safetensors"


@dataclass(frozen=True)
class ExpertLoRAConfig:
    r: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    projections: tuple[str, ...] = ("gate_up_proj", "down_proj")


class ExpertLoRAAdapter(torch.nn.Module):
    """A: in -> r and B: r -> out for every expert, in the base weight's layout."""

    def __init__(
        self,
        num_experts: int,
        in_features: int,
        out_features: int,
        config: ExpertLoRAConfig,
        transposed: bool,
        dtype: torch.dtype,
        device,
    ):
        super().__init__()
        r = config.r
        if transposed:  # [E, in, out] layout (GPT-OSS)
            a_shape, b_shape = (num_experts, in_features, r), (num_experts, r, out_features)
        else:  # [E, out, in] layout (Qwen3-MoE)
            a_shape, b_shape = (num_experts, r, in_features), (num_experts, out_features, r)
        self.lora_A = torch.nn.Parameter(torch.empty(a_shape, dtype=dtype, device=device))
        self.lora_B = torch.nn.Parameter(torch.zeros(b_shape, dtype=dtype, device=device))
        torch.nn.init.normal_(self.lora_A, std=1.0 / math.sqrt(in_features))
        self.scale = config.alpha / r
        self.dropout = torch.nn.Dropout(config.dropout) if config.dropout else torch.nn.Identity()

    def forward(self, linear, x_S: torch.Tensor, transposed: bool, groups) -> torch.Tensor:
        mid = linear(self.dropout(x_S), self.lora_A, None, transposed, expert_ids_S=groups.expert_ids_S)
        return linear(mid, self.lora_B, None, transposed, expert_ids_S=groups.expert_ids_S) * self.scale


class ExpertLoRA(torch.nn.Module):
    def __init__(self, adapters: dict[str, ExpertLoRAAdapter], config: ExpertLoRAConfig):
        super().__init__()
        self.adapters = torch.nn.ModuleDict(adapters)
        self.config = config


def _shape(module, name: str) -> tuple[int, int, int]:
    holder = getattr(module, "slipstream_nf4", None)
    if holder is not None and name in holder.shapes:
        return holder.shapes[name]
    return tuple(getattr(module, name).shape)


def _dtype_device(module):
    """The dtype the experts compute in: a 4-bit store's compute dtype (its float buffers are
    quantization statistics), else the first floating parameter's."""
    holder = getattr(module, "slipstream_nf4", None)
    if holder is not None:
        device = next((t.device for t in holder.buffers()), torch.device("cpu"))
        return getattr(torch, holder.settings.compute_dtype), device
    for tensor in [*module.parameters(), *module.buffers()]:
        if tensor.is_floating_point():
            return tensor.dtype, tensor.device
    return torch.float32, torch.device("cpu")


def add_expert_lora(
    model: torch.nn.Module, config: ExpertLoRAConfig | None = None, **kwargs
) -> list[torch.nn.Parameter]:
    """Attach a per-expert LoRA to every experts module; returns the new trainable parameters.

    The base expert weights are frozen. Runs with sorted routing only.
    """
    config = config or ExpertLoRAConfig(**kwargs)
    modules = experts_modules(model)
    if not modules:
        raise ValueError(f"{type(model).__name__} has no experts modules for expert LoRA")
    params: list[torch.nn.Parameter] = []
    for module in modules:
        if getattr(module, "slipstream_lora", None) is not None:
            raise ValueError(f"{type(module).__name__} already has an expert LoRA")
        dtype, device = _dtype_device(module)
        adapters = {}
        for name in config.projections:
            if name == "gate_up_proj" and not module.has_gate:
                name = "up_proj"
            experts, a, b = _shape(module, name)
            in_features, out_features = (a, b) if module.is_transposed else (b, a)
            adapters[name] = ExpertLoRAAdapter(
                experts, in_features, out_features, config, module.is_transposed, dtype, device
            )
        for param in module.parameters():
            param.requires_grad_(False)
        module.slipstream_lora = ExpertLoRA(adapters, config)
        params += list(module.slipstream_lora.parameters())
    return params


def expert_lora_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {
        name: p.detach().contiguous() for name, p in model.named_parameters() if ".slipstream_lora." in name
    }


def save_expert_lora(model: torch.nn.Module, directory: str | os.PathLike) -> Path:
    """Write the adapters (safetensors) and their config (JSON) to ``directory``, atomically per file."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    configs = {
        m.slipstream_lora.config for m in experts_modules(model) if getattr(m, "slipstream_lora", None)
    }
    if len(configs) != 1:
        raise ValueError("save_expert_lora needs exactly one expert LoRA configuration on the model")
    for name, write in (
        (WEIGHTS_FILE, lambda p: save_file(expert_lora_state_dict(model), str(p))),
        (CONFIG_FILE, lambda p: p.write_text(json.dumps(asdict(configs.pop()), indent=1))),
    ):
        with atomic_file(directory / name) as tmp:
            write(tmp)
    return directory


def load_expert_lora(model: torch.nn.Module, directory: str | os.PathLike) -> torch.nn.Module:
    """Attach expert LoRA adapters saved by ``save_expert_lora`` and load their weights."""
    from safetensors.torch import load_file

    directory = Path(directory)
    spec = json.loads((directory / CONFIG_FILE).read_text())
    spec["projections"] = tuple(spec["projections"])
    add_expert_lora(model, ExpertLoRAConfig(**spec))
    saved = load_file(str(directory / WEIGHTS_FILE))
    params = dict(model.named_parameters())
    missing = sorted(set(expert_lora_state_dict(model)) - set(saved))
    unexpected = sorted(set(saved) - set(params))
    if missing or unexpected:
        raise KeyError(f"{directory / WEIGHTS_FILE}: missing {missing[:3]}, unexpected {unexpected[:3]}")
    with torch.no_grad():
        for name, tensor in saved.items():
            params[name].copy_(tensor)
    return model


def merge_expert_lora(model: torch.nn.Module) -> int:
    """Fold every expert LoRA into its dense expert weights (``W_e += scale * B_e A_e``) and drop it.

    The adapter computes ``x_e A_e B_e * scale`` beside ``x_e W_e`` (``ExpertLoRAAdapter``), so the
    merged weight is ``W + scale * B @ A`` in the [E, out, in] layout and ``W + scale * A @ B`` in
    the transposed [E, in, out] one; the product is formed in fp32 and rounded once into W's
    dtype. 4-bit experts must be dequantized first. Returns how many experts modules were merged.
    """
    merged = 0
    for module in experts_modules(model):
        lora = getattr(module, "slipstream_lora", None)
        if lora is None:
            continue
        if getattr(module, "slipstream_nf4", None) is not None:
            raise ValueError(
                f"{type(module).__name__}: dequantize its 4-bit experts before merging expert LoRA"
            )
        with torch.no_grad():
            for name, adapter in lora.adapters.items():
                weight = getattr(module, name)
                a, b = adapter.lora_A.float(), adapter.lora_B.float()
                delta = (a @ b if module.is_transposed else b @ a) * adapter.scale
                if delta.shape != weight.shape:
                    raise ValueError(
                        f"{type(module).__name__}.{name}: expert LoRA delta {tuple(delta.shape)} "
                        f"does not fit the weight {tuple(weight.shape)}"
                    )
                weight.copy_((weight.float() + delta.to(weight.device)).to(weight.dtype))
        del module.slipstream_lora
        merged += 1
    return merged
