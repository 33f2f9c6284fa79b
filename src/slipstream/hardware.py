"""What this CPU can do fast: its class (AMX, AVX512-BF16 or AVX2 at most), probed once, overridable.

Every hardware-dependent choice slipstream makes on a CPU (``model.dtype: auto``, and through the
dtype every rule keyed to it) starts from :func:`cpu_class`. The classes, fastest bf16 first:

- ``amx``: AMX tiles (Intel Sapphire Rapids and later): bf16 GEMMs native, ~5x fp32;
- ``avx512-bf16``: AVX512-BF16 without AMX (AMD Zen 4/5, Intel Cooper Lake): bf16 native;
- ``avx2``: neither (AMD Zen 3, older Intel): bf16 is emulated, slower than fp32;
- ``other``: a CPU torch reports no x86 vector extension for (Arm, ...): no bf16 rule, fp32.

``SLIPSTREAM_CPU_CLASS`` (one of the names above) overrides the probe, for users and tests alike:
``SLIPSTREAM_CPU_CLASS=avx2`` makes every decision as on an AVX2-only, fp32-only CPU. It changes
slipstream's decisions, not torch's kernels; to run the kernels as such a CPU would too, start the
process with ``ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2`` (what ``.ci/run`` does for its
AVX2 pass; torch reads those once, at import).
"""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, get_args

import torch

CpuClassName = Literal["amx", "avx512-bf16", "avx2", "other"]
CPU_CLASSES: tuple[str, ...] = get_args(CpuClassName)
ENV_CPU_CLASS = "SLIPSTREAM_CPU_CLASS"
BF16_NATIVE = frozenset({"amx", "avx512-bf16"})


@dataclass(frozen=True)
class CpuClass:
    """The CPU's class (:data:`CPU_CLASSES`), whether bf16 is native there, and where it came from."""

    name: str
    overridden: bool  # from SLIPSTREAM_CPU_CLASS, not the probe

    @property
    def bf16_native(self) -> bool:
        return self.name in BF16_NATIVE

    def describe(self) -> str:
        """'AMX' / 'AVX512-BF16 (no AMX)' / ..., with ' (SLIPSTREAM_CPU_CLASS)' when overridden."""
        text = {
            "amx": "AMX",
            "avx512-bf16": "AVX512-BF16 (no AMX)",
            "avx2": "neither AMX nor AVX512-BF16",
            "other": "no x86 bf16 extension",
        }[self.name]
        return text + (f" ({ENV_CPU_CLASS}={self.name})" if self.overridden else "")


def probed_cpu_class() -> str:
    """The class torch's own CPU probes find (never the override)."""
    if getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)():
        return "amx"
    if getattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)():
        return "avx512-bf16"
    capability = torch.backends.cpu.get_cpu_capability()
    return "avx2" if capability.startswith("AVX") else "other"


def cpu_class() -> CpuClass:
    """This CPU's class: ``SLIPSTREAM_CPU_CLASS`` where set (ValueError naming it if unknown), else probed."""
    override = os.environ.get(ENV_CPU_CLASS, "").strip()
    if override:
        if override not in CPU_CLASSES:
            raise ValueError(f"{ENV_CPU_CLASS}={override!r}: expected one of {', '.join(CPU_CLASSES)}")
        return CpuClass(override, overridden=True)
    return CpuClass(probed_cpu_class(), overridden=False)


# Environment variables that cap the instruction sets torch's CPU kernels use (read once, at import):
# a figure measured under them is another machine's.
KERNEL_CAPS = ("ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA")


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo), else what platform knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def device_identity(device: torch.device) -> dict[str, str]:
    """What a figure measured on ``device`` is keyed by (the matmul peak, the calibrations, the
    ablation verdicts): its name and torch's version; on a CPU also its class (the override
    included) and any cap on torch's kernels, so an emulated AVX2 machine never shares a cached
    figure with the real one."""
    if device.type == "cuda":
        return {"device": torch.cuda.get_device_name(device), "torch": torch.__version__}
    caps = ",".join(f"{name}={os.environ[name]}" for name in KERNEL_CAPS if os.environ.get(name))
    return {
        "device": cpu_name(),
        "cpu_class": cpu_class().name,
        "kernels": torch.backends.cpu.get_cpu_capability() + (f" ({caps})" if caps else ""),
        "torch": torch.__version__,
    }
