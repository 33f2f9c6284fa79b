"""Which dtype ``model.dtype: auto`` trains in: bf16 where the device runs it fast, else fp32."""

from __future__ import annotations

import torch


def fast_bf16(device: torch.device) -> tuple[bool, str]:
    """Whether bf16 matmuls are native on ``device``, and why (CUDA >= sm80; AVX512-BF16 or AMX on a CPU)."""
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        if major >= 8:
            return True, f"CUDA compute capability {major}.{minor} has bf16 tensor cores"
        return False, f"CUDA compute capability {major}.{minor} has no bf16 tensor cores"
    if device.type == "cpu":
        amx = getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)()
        avx512_bf16 = getattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)()
        if amx or avx512_bf16:
            found = " and ".join(n for n, ok in (("AMX", amx), ("AVX512-BF16", avx512_bf16)) if ok)
            return True, f"this CPU has {found}"
        return False, "this CPU has neither AMX nor AVX512-BF16 (bf16 would be emulated, slower than fp32)"
    return False, f"no bf16 rule for device type {device.type!r}"


def resolve_dtype(name: str, device: torch.device) -> tuple[torch.dtype, str]:
    """The torch dtype for a config's ``model.dtype`` and a sentence saying how it was chosen."""
    if name != "auto":
        return getattr(torch, name), f"dtype {name} (set)"
    fast, why = fast_bf16(device)
    chosen = torch.bfloat16 if fast else torch.float32
    return chosen, f"dtype {str(chosen).removeprefix('torch.')} (auto: {why})"
