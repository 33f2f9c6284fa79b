"""Which dtype ``model.dtype: auto`` trains in: bf16 where the device runs it fast, else fp32."""

from __future__ import annotations

import torch

from ..hardware import cpu_class


def fast_bf16(device: torch.device) -> tuple[bool, str]:
    """Whether bf16 matmuls are native on ``device``, and why (CUDA >= sm80; AVX512-BF16 or AMX on a CPU:
    ``hardware.cpu_class``, which ``SLIPSTREAM_CPU_CLASS`` overrides)."""
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        if major >= 8:
            return True, f"CUDA compute capability {major}.{minor} has bf16 tensor cores"
        return False, f"CUDA compute capability {major}.{minor} has no bf16 tensor cores"
    if device.type == "cpu":
        found = cpu_class()
        if found.bf16_native:
            return True, f"this CPU has {found.describe()}"
        return False, f"this CPU has {found.describe()} (bf16 would be emulated, slower than fp32)"
    return False, f"no bf16 rule for device type {device.type!r}"


def resolve_dtype(name: str, device: torch.device) -> tuple[torch.dtype, str]:
    """The torch dtype for a config's ``model.dtype`` and a sentence saying how it was chosen."""
    if name != "auto":
        return getattr(torch, name), f"dtype {name} (set)"
    fast, why = fast_bf16(device)
    chosen = torch.bfloat16 if fast else torch.float32
    return chosen, f"dtype {str(chosen).removeprefix('torch.')} (auto: {why})"
