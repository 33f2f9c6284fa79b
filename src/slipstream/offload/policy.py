"""Which checkpointing mode to run, decided once from a description of the device, and why.

Every decision is returned with its reason (the caller logs each once) and each can be
overridden: by the mode asked for (``SLIPSTREAM_CHECKPOINTING`` is applied to it, and said,
by :class:`slipstream.Speedups`) and by ``SLIPSTREAM_PINNED=0`` (pageable host buffers). The device is described by a small
dataclass so tests can walk every branch without the hardware.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Literal, get_args

import torch

# The checkpointing choices, defined once: Speedups, the configs and the CLIs read this.
Checkpointing = Literal["off", "recompute", "offload", "offload-double", "auto"]
MODES = tuple(mode for mode in get_args(Checkpointing) if mode != "auto")


@dataclass(frozen=True)
class DeviceDescription:
    """What the policy needs to know about the training device."""

    has_cuda: bool
    name: str = "cpu"
    is_integrated: bool = False  # unified memory (e.g. Grace Hopper superchips, Jetson, laptops)
    free_bytes: int = 0
    pinned_ok: bool = True

    @staticmethod
    def detect(device: torch.device | None = None) -> DeviceDescription:
        if not torch.cuda.is_available() or (device is not None and device.type != "cuda"):
            return DeviceDescription(has_cuda=False)
        index = (
            device.index if device is not None and device.index is not None else torch.cuda.current_device()
        )
        props = torch.cuda.get_device_properties(index)
        free, _ = torch.cuda.mem_get_info(index)
        return DeviceDescription(
            has_cuda=True,
            name=props.name,
            is_integrated=bool(getattr(props, "is_integrated", False)),
            free_bytes=int(free),
            pinned_ok=_pinned_allocation_works(),
        )


def _pinned_allocation_works() -> bool:
    """Pinned memory can be capped (WSL) or missing; try a small allocation."""
    try:
        torch.empty(1 << 20, dtype=torch.uint8).pin_memory()
        return True
    except RuntimeError:
        return False


@dataclass(frozen=True)
class CheckpointPolicy:
    mode: str
    pinned: bool
    reasons: tuple[str, ...]


def choose_policy(requested: str, device: DeviceDescription, buffer_bytes: int = 0) -> CheckpointPolicy:
    """Resolve ``requested`` ("auto" or a mode) for ``device``.

    ``buffer_bytes``: the size of one reload buffer (one layer input), to check the second
    buffer of "offload-double" fits in free device memory.
    """
    reasons: list[str] = []
    if requested not in (*MODES, "auto"):
        raise ValueError(f"checkpointing must be one of {', '.join((*MODES, 'auto'))}, got {requested!r}")
    mode = "offload-double" if requested == "auto" else requested
    if requested == "auto":
        reasons.append("auto: offload with double-buffered, prefetched reloads where the device allows")
    if mode.startswith("offload") and not device.has_cuda:
        reasons.append(f"{mode} needs CUDA streams; no CUDA device: recompute instead")
        mode = "recompute"
    if mode == "offload-double" and device.is_integrated:
        reasons.append(
            f"{device.name} is a unified-memory device: single buffer (double buffering was 2.15x slower there)"
        )
        mode = "offload"
    if mode == "offload-double" and buffer_bytes and device.free_bytes < 2 * buffer_bytes:
        reasons.append(
            f"{device.free_bytes / 2**20:.0f} MiB free is not enough for a second {buffer_bytes / 2**20:.0f} MiB "
            "reload buffer: single buffer"
        )
        mode = "offload"
    pinned = device.pinned_ok and os.environ.get("SLIPSTREAM_PINNED", "1") != "0"
    if mode.startswith("offload") and not pinned:
        why = "SLIPSTREAM_PINNED=0" if device.pinned_ok else "pinned allocation failed (capped, e.g. WSL)"
        reasons.append(f"{why}: pageable host buffers (copies will not overlap as well)")
    return CheckpointPolicy(mode=mode, pinned=pinned, reasons=tuple(reasons))
