"""What doctor says about the machine: the device, a bounded pinned-memory probe, the versions.

Built on what exists: the benchmark fingerprint (CPU name, torch / transformers / slipstream
versions, CUDA and driver), the dtype rule of ``model.dtype: auto`` (``train.precision``) and the
offload policy's device description (``offload.policy.DeviceDescription``).
"""

from __future__ import annotations

import importlib.metadata
import os
import time
from dataclasses import dataclass
from typing import Any

import torch

from ..bench.fingerprint import cpu_name, fingerprint
from ..hardware import cpu_class, cpu_generation
from ..offload.policy import DeviceDescription
from ..train.precision import fast_bf16

# The pinned-memory probe: doubling allocations from PINNED_START, up to the cap (at most a
# quarter of the host's RAM), for at most PINNED_TIME_S seconds.
PINNED_START = 64 << 20
PINNED_CAP = 16 << 30
PINNED_TIME_S = 5.0
# Optional packages doctor names the version of (their distribution names).
PACKAGES = ("transformers", "peft", "trl", "bitsandbytes", "liger-kernel")


def gib(value: float) -> str:
    return f"{value / 2**30:.1f} GiB"


def training_device() -> torch.device:
    """The device ``slipstream train`` and ``slipstream ab`` pick by default: the first GPU, else the CPU."""
    return (
        torch.device("cuda", torch.cuda.current_device())
        if torch.cuda.is_available()
        else torch.device("cpu")
    )


def host_ram_bytes() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None


@dataclass
class PinnedProbe:
    """The largest pinned host allocation that succeeded, and why the probe stopped."""

    applicable: bool
    largest_bytes: int = 0
    stopped: str = ""  # "cap", "time bound", "failed at N bytes (error)"
    seconds: float = 0.0

    def describe(self) -> str:
        if not self.applicable:
            return "not applicable (no CUDA device: pinned memory only speeds copies to a GPU)"
        if self.largest_bytes == 0:
            return f"none: the first {gib(PINNED_START)} pinned allocation failed ({self.stopped})"
        if self.stopped.startswith("failed"):
            return f"{gib(self.largest_bytes)} ({self.stopped})"
        return f">= {gib(self.largest_bytes)} (probe stopped at its {self.stopped}, {self.seconds:.1f} s)"


def probe_pinned(
    cap_bytes: int = PINNED_CAP, time_s: float = PINNED_TIME_S, start_bytes: int = PINNED_START
) -> PinnedProbe:
    """Double a pinned host allocation from ``start_bytes`` until one fails, ``cap_bytes`` (at most a
    quarter of the host RAM) is reached or the next one would end past ``time_s`` (pinning takes
    time in proportion to size). One block at a time: each is freed, and the host allocator's
    cache emptied, before the next."""
    if not torch.cuda.is_available():
        return PinnedProbe(applicable=False)
    ram = host_ram_bytes()
    cap = min(cap_bytes, ram // 4) if ram else cap_bytes
    empty_host_cache = getattr(torch._C, "_host_emptyCache", lambda: None)  # else freed blocks stay pinned
    size, largest, stopped, last_s = start_bytes, 0, "cap", 0.0
    began = time.perf_counter()
    while size <= cap:
        if time.perf_counter() - began + 2 * last_s > time_s:
            stopped = "time bound"
            break
        allocated = time.perf_counter()
        try:
            block = torch.empty(size, dtype=torch.uint8, pin_memory=True)
        except RuntimeError as error:
            stopped = f"failed at {gib(size)}: {' '.join(str(error).split())[:120]}"
            break
        del block
        empty_host_cache()
        last_s = time.perf_counter() - allocated
        largest, size = size, size * 2
    empty_host_cache()
    return PinnedProbe(True, largest, stopped, time.perf_counter() - began)


def describe_device(
    device: torch.device, info: dict[str, Any] | None = None, probe_pinned_memory: bool = True
) -> dict[str, Any]:
    """The device doctor checks, and the host CPU beside it (``info``: the benchmark fingerprint)."""
    info = info or fingerprint()
    bf16, bf16_why = fast_bf16(device)
    ram = host_ram_bytes()
    facts: dict[str, Any] = {
        "type": device.type,
        "name": torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name(),
        "cpu": info["cpu"],
        "cpu_cores": info["cpu_count"],
        "torch_threads": info["torch_threads"],
        "ram_bytes": ram,
        "bf16": bf16,
        "bf16_why": bf16_why,
    }
    if device.type == "cpu":
        found = cpu_class()
        facts["cpu_class"] = found.name
        facts["cpu_class_text"] = f"{found.name}: {found.describe()}"
        facts["cpu_generation"] = cpu_generation()
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        description = DeviceDescription.detect(device)
        facts.update(
            memory_bytes=int(props.total_memory),
            free_bytes=description.free_bytes,
            compute_capability=f"{props.major}.{props.minor}",
            multiprocessors=props.multi_processor_count,
            unified_memory=description.is_integrated,
            pinned_ok=description.pinned_ok,
            driver=info.get("driver"),
        )
    probe = probe_pinned() if probe_pinned_memory else PinnedProbe(applicable=device.type == "cuda")
    facts["pinned_probe"] = {
        "applicable": probe.applicable,
        "largest_bytes": probe.largest_bytes,
        "stopped": probe.stopped or ("not run" if probe.applicable and not probe_pinned_memory else ""),
        "text": probe.describe() if probe_pinned_memory or not probe.applicable else "not probed",
    }
    return facts


def device_rows(facts: dict[str, Any]) -> list[tuple[str, str]]:
    """(what, value) lines for the device table."""
    rows = []
    if facts["type"] == "cuda":
        shared = "yes (integrated GPU)" if facts["unified_memory"] else "no (discrete GPU)"
        rows += [
            ("device", f"{facts['name']} (CUDA)"),
            ("memory", f"{gib(facts['memory_bytes'])} ({gib(facts['free_bytes'])} free)"),
            ("compute capability", f"{facts['compute_capability']} ({facts['multiprocessors']} SMs)"),
            ("unified memory", shared),
            ("bf16", f"{'yes' if facts['bf16'] else 'no'} ({facts['bf16_why']})"),
            ("host CPU", f"{facts['cpu']} ({facts['cpu_cores']} cores)"),
        ]
    else:
        rows += [
            ("device", f"CPU: {facts['name']}"),
            (
                "CPU class",
                facts["cpu_class_text"] + (f"; {facts['cpu_generation']}" if facts["cpu_generation"] else ""),
            ),
            ("cores", f"{facts['cpu_cores']} ({facts['torch_threads']} torch threads)"),
            ("bf16", f"{'yes' if facts['bf16'] else 'no'} ({facts['bf16_why']})"),
        ]
    if facts.get("ram_bytes"):
        rows.append(("RAM", gib(facts["ram_bytes"])))
    rows.append(("pinned memory", facts["pinned_probe"]["text"]))
    peak = facts.get("matmul_peak")
    if peak:
        text = (
            f"{peak['tflops']:.3g} TFLOP/s in {peak['dtype']} at {peak['threads']} threads (measured "
            f"{peak['measured']}{', cached' if peak['cached'] else ''}; what MFU in ab and train is against"
            + (f"; kept over the {peak['kept_over']}" if peak.get("kept_over") else "")
            + ("; --remeasure-peak measures it again" if peak["cached"] else "")
        )
        rows.append(("matmul peak", text + ")"))
    return rows


def versions(info: dict[str, Any] | None = None) -> dict[str, str | None]:
    """torch (with CUDA and cuDNN where present), the Hugging Face stack, slipstream; None: not installed."""
    info = info or fingerprint()
    found: dict[str, str | None] = {"python": info["python"], "torch": torch.__version__}
    if torch.version.cuda:
        found["cuda"] = torch.version.cuda
        found["cudnn"] = str(torch.backends.cudnn.version()) if torch.backends.cudnn.is_available() else None
        found["nvidia driver"] = info.get("driver")
    for package in PACKAGES:
        try:
            found[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            found[package] = None
    found["slipstream"] = info["slipstream"] + (
        f" @ {info['git_revision']}" if info.get("git_revision") else ""
    )
    return found
