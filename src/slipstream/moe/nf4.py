"""4-bit (NF4) experts for MoE QLoRA.

bitsandbytes' 4-bit loading quantizes ``nn.Linear`` layers only, so an MoE model's 3D expert
weights — nearly all of its parameters — stay in full precision. ``quantize_experts`` turns
each expert's weight into NF4 with bitsandbytes' functional API (blockwise, optional double
quantization of the block scales), one quantized block per expert, and drops the dense
parameter. The sorted routing then dequantizes only the experts that received tokens, one at
a time, inside its loop; the experts stay frozen (train them through expert LoRA).

Everything lives in buffers of a small ``NF4Experts`` module, so ``state_dict`` /
``load_state_dict`` round-trip; ``save_quantized`` / ``load_quantized`` do it for a whole model.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ..atomic import atomic_directory
from ..extras import require
from .experts import experts_modules, use_sorted_experts

MANIFEST = "slipstream_quantization.json"


@dataclass(frozen=True)
class NF4Settings:
    blocksize: int = 64
    double_quant: bool = False
    compute_dtype: str = "float32"  # the dtype dequantized weights take (the activations' dtype wins)


class NF4ExpertStore:
    """One projection's experts in NF4; ``expert_weight(e)`` dequantizes expert e only."""

    def __init__(self, holder: NF4Experts, name: str):
        self.holder, self.name = holder, name
        self.weight_shape = tuple(holder.shapes[name])  # (E, a, b), the dense layout

    def _buffer(self, part: str) -> torch.Tensor:
        return getattr(self.holder, f"{self.name}__{part}")

    def expert_weight(self, expert: int, dtype: torch.dtype) -> torch.Tensor:
        """One expert's dense weight."""
        experts = torch.tensor([expert], device=self._buffer("packed").device)
        return self.dequantize_many(experts, dtype)[0]

    def _byte_table(self) -> torch.Tensor:
        """[256, 2]: the NF4 values of a byte's high and low nibble, built once per store."""
        code = self._buffer("code")
        if getattr(self, "_table", None) is None or self._table.device != code.device:
            code = code.to(torch.float32)
            self._table = torch.stack((code.repeat_interleave(16), code.repeat(16)), dim=-1)
        return self._table

    def dequantize_many(self, experts: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Experts ``experts`` (int64 ids) dequantized in one vectorised pass: ``[g, a, b]``.

        The same NF4 arithmetic as ``bitsandbytes.functional.dequantize_4bit`` (tested bit
        for bit against it), minus one call and its overhead per expert. Also, bitsandbytes
        0.50.2's CPU kernel returns wrong values for a weight narrower than one block (e.g. a
        [64, 32] expert at blocksize 64; see tests/moe/test_nf4_and_lora.py); this does not.
        """
        settings = self.holder.settings
        packed = self._buffer("packed").index_select(0, experts)  # [g, n/2], two codes a byte, high first
        # One lookup per byte in a 256 x 2 table (both nibbles' values) instead of one per code.
        values = self._byte_table().index_select(0, packed.view(-1).int()).view(packed.shape[0], -1)  # [g, n]
        absmax = self._buffer("absmax").index_select(0, experts)
        if settings.double_quant:
            nested = self._buffer("nested_absmax").index_select(0, experts)
            nested = nested.repeat_interleave(256, dim=1)[:, : absmax.shape[1]]
            offset = self._buffer("offset").index_select(0, experts).unsqueeze(1)
            absmax = self._buffer("nested_code")[absmax.long()] * nested + offset
        g, n = values.shape
        blocks = absmax.shape[1]
        if n != blocks * settings.blocksize:  # a last, partial block
            values = torch.nn.functional.pad(values, (0, blocks * settings.blocksize - n))
        dense = (values.view(g, blocks, settings.blocksize) * absmax.unsqueeze(-1)).view(g, -1)[:, :n]
        return dense.view(g, *self.weight_shape[1:]).to(dtype)

    def dense(self) -> torch.Tensor:
        """All experts dequantized, ``[E, a, b]`` (for tests and for exporting)."""
        return torch.stack([self.expert_weight(e, torch.float32) for e in range(self.weight_shape[0])])


class NF4Experts(torch.nn.Module):
    """Buffers holding an experts module's NF4 weights (a child of that module)."""

    def __init__(self, shapes: dict[str, tuple[int, ...]], settings: NF4Settings):
        super().__init__()
        self.shapes = {name: tuple(shape) for name, shape in shapes.items()}
        self.settings = settings

    @property
    def stores(self) -> dict[str, NF4ExpertStore]:
        """One store per projection, made once (each keeps its small lookup table)."""
        if getattr(self, "_stores", None) is None:
            self._stores = {name: NF4ExpertStore(self, name) for name in self.shapes}
        return self._stores

    def nbytes(self) -> int:
        return sum(buf.numel() * buf.element_size() for buf in self.buffers())

    def allocate(self, name: str, like: dict[str, torch.Tensor]) -> None:
        for part, tensor in like.items():
            self.register_buffer(f"{name}__{part}", tensor)


def _quantize_projection(weight_E: torch.Tensor, settings: NF4Settings) -> dict[str, torch.Tensor]:
    bnb = require("bitsandbytes.functional", "4-bit (NF4) experts")
    parts: dict[str, list[torch.Tensor]] = {"packed": [], "absmax": [], "nested_absmax": [], "offset": []}
    code = nested_code = None
    for expert_weight in weight_E.detach().float():
        packed, state = bnb.quantize_4bit(
            expert_weight.contiguous(),
            blocksize=settings.blocksize,
            quant_type="nf4",
            compress_statistics=settings.double_quant,
        )
        parts["packed"].append(packed.view(-1))
        parts["absmax"].append(state.absmax)
        code = state.code
        if settings.double_quant:
            parts["nested_absmax"].append(state.state2.absmax)
            parts["offset"].append(torch.as_tensor(state.offset, dtype=torch.float32).reshape(()))
            nested_code = state.state2.code
    out = {"packed": torch.stack(parts["packed"]), "absmax": torch.stack(parts["absmax"]), "code": code}
    if settings.double_quant:
        out.update(
            nested_absmax=torch.stack(parts["nested_absmax"]),
            offset=torch.stack(parts["offset"]),
            nested_code=nested_code,
        )
    return out


def quantize_experts(
    model: torch.nn.Module, double_quant: bool = False, blocksize: int = 64, compute_dtype: str | None = None
) -> torch.nn.Module:
    """Quantize every expert weight of ``model`` to NF4, in place; returns the model.

    The dense 3D parameters are removed (biases stay, in full precision). The model's experts
    switch to sorted routing, the only path that runs 4-bit experts.
    """
    modules = experts_modules(model)
    if not modules:
        raise ValueError(f"{type(model).__name__} has no experts modules to quantize")
    use_sorted_experts(model)  # 4-bit experts run only through sorted routing
    for module in modules:
        if getattr(module, "slipstream_nf4", None) is not None:
            continue
        names = ("gate_up_proj" if module.has_gate else "up_proj", "down_proj")
        dtype = compute_dtype or str(getattr(module, names[0]).dtype).removeprefix("torch.")
        settings = NF4Settings(blocksize=blocksize, double_quant=double_quant, compute_dtype=dtype)
        holder = NF4Experts({n: tuple(getattr(module, n).shape) for n in names}, settings)
        for name in names:
            holder.allocate(name, _quantize_projection(getattr(module, name), settings))
            delattr(module, name)
        module.slipstream_nf4 = holder
    return model


def dequantized_reference(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``{module path.projection: dense [E, a, b]}`` of every 4-bit expert weight (for checks)."""
    out = {}
    for path, module in model.named_modules():
        holder = getattr(module, "slipstream_nf4", None)
        if holder is not None:
            for name, store in holder.stores.items():
                out[f"{path}.{name}"] = store.dense()
    return out


def dequantize_experts(model: torch.nn.Module, dtype: torch.dtype | None = None) -> int:
    """Undo ``quantize_experts``: each 4-bit expert weight becomes a dense frozen parameter again.

    The values are exactly those the sorted routing computes with (``NF4ExpertStore.dense``),
    in ``dtype`` (default: the store's compute dtype). Returns how many experts modules changed.
    """
    changed = 0
    for module in experts_modules(model):
        holder = getattr(module, "slipstream_nf4", None)
        if holder is None:
            continue
        target = dtype or getattr(torch, holder.settings.compute_dtype)
        for name, store in holder.stores.items():
            dense = store.dense().to(target)
            module.register_parameter(name, torch.nn.Parameter(dense, requires_grad=False))
        del module.slipstream_nf4
        changed += 1
    return changed


def _manifest(model) -> dict:
    layers = {}
    for path, module in model.named_modules():
        holder = getattr(module, "slipstream_nf4", None)
        if holder is not None:
            layers[path] = {
                "shapes": {k: list(v) for k, v in holder.shapes.items()},
                "settings": asdict(holder.settings),
            }
    return {"format": "slipstream-nf4-experts", "version": 1, "layers": layers}


def save_quantized(model: torch.nn.Module, directory: str | os.PathLike) -> Path:
    """Config + full state dict (NF4 expert buffers included) + manifest, written atomically."""
    from safetensors.torch import save_model

    directory = Path(directory)
    with atomic_directory(directory, existing="refuse") as tmp:
        model.config.save_pretrained(tmp)
        save_model(model, str(tmp / "model.safetensors"))
        (tmp / MANIFEST).write_text(json.dumps(_manifest(model), indent=1))
    return directory


def load_quantized(directory: str | os.PathLike, **model_kwargs) -> torch.nn.Module:
    """Rebuild a model saved by ``save_quantized``: structure from the manifest, then the weights."""
    from safetensors.torch import load_model
    from transformers import AutoConfig, AutoModelForCausalLM

    directory = Path(directory)
    manifest_path = directory / MANIFEST
    if not manifest_path.exists():
        raise FileNotFoundError(f"{manifest_path}: not a slipstream 4-bit experts checkpoint")
    manifest = json.loads(manifest_path.read_text())
    config = AutoConfig.from_pretrained(directory, local_files_only=True)
    model = AutoModelForCausalLM.from_config(config, **model_kwargs)
    modules = dict(model.named_modules())
    for path, spec in manifest["layers"].items():
        if path not in modules:
            raise KeyError(f"{manifest_path}: layer {path!r} is not in a {type(model).__name__}")
        module = modules[path]
        settings = NF4Settings(**spec["settings"])
        holder = NF4Experts({k: tuple(v) for k, v in spec["shapes"].items()}, settings)
        for name, shape in holder.shapes.items():
            # right shapes, overwritten by the weights
            holder.allocate(name, _quantize_projection(torch.zeros(shape), settings))
            delattr(module, name)
        module.slipstream_nf4 = holder
    load_model(model, str(directory / "model.safetensors"), strict=True)
    return model
