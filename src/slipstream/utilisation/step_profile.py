"""Where one training step's time goes: matmuls, attention, dtype copies, compiled kernels, the
optimizer and everything else, from one step run under ``torch.profiler``.

MFU says how far a step is from the machine; this says why. The GEMM rate (the linear layers'
model FLOPs over the time the matmuls took) against the measured peak separates the two causes:
matmuls that run slowly at the model's shapes, and time spent outside matmuls altogether (the
"non-matmul half" of a step on small models).

Each profiled op's *self* time goes to one category. An op inside an attention region (SDPA and
flash / varlen kernels, slipstream's short-document kernel, forward or backward) counts as
attention whatever it is (the short kernel's bmm and softmax are attention work); inside a
compiled graph as compiled; inside the optimizer's step as optimizer; otherwise its own name
decides (``aten::mm`` / ``addmm`` / ``bmm`` / ... are matmuls, ``copy_`` / ``_to_copy`` dtype
copies). On CUDA the device time of each kernel is used and kernels are named by the op that
launched them. CPU self times include the profiler's own overhead per op (a few microseconds),
which inflates the many small ops against the few large ones: the shares are a diagnosis, the
step times of the A/B table stay the figures.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.autograd import DeviceType

CATEGORIES = ("matmul", "attention", "dtype_copies", "compiled", "optimizer", "other")

MATMUL_OPS = frozenset(
    {
        "aten::mm",
        "aten::addmm",
        "aten::bmm",
        "aten::baddbmm",
        "aten::_grouped_mm",
        "aten::_scaled_mm",
        "aten::_int_mm",
        "aten::mkldnn_linear",
        "mkldnn::_linear_pointwise",
        "aten::_addmm_activation",
    }
)
COPY_OPS = frozenset({"aten::copy_", "aten::_to_copy"})
# regions whose every op is attention work (matched as substrings of the event name)
ATTENTION_MARKERS = (
    "scaled_dot_product",
    "flash_attention",
    "efficient_attention",
    "cudnn_attention",
    "varlen_attn",
    "ShortCausalAttention",
)
COMPILED_MARKERS = ("CompiledFxGraph", "Torch-Compiled Region", "CompiledFunction")
OPTIMIZER_MARKERS = ("Optimizer.step", "Optimizer.zero_grad")


def _region(name: str) -> str | None:
    """The category a region of this name claims for everything inside it, or None."""
    if any(marker in name for marker in ATTENTION_MARKERS):
        return "attention"
    if any(marker in name for marker in COMPILED_MARKERS):
        return "compiled"
    if any(marker in name for marker in OPTIMIZER_MARKERS):
        return "optimizer"
    return None


def category_of(name: str, ancestors: list[str]) -> str:
    """The category of an op named ``name`` nested in regions ``ancestors`` (innermost first)."""
    for region in (name, *ancestors):
        found = _region(region)
        if found:
            return found
    if name in MATMUL_OPS or "bitsandbytes" in name or "gemm" in name.lower():
        return "matmul"
    if name in COPY_OPS:
        return "dtype_copies"
    return "other"


def categorize(events, cuda: bool = False) -> dict[str, float]:
    """Self seconds per category over profiler ``events`` (``prof.events()``)."""
    seconds = dict.fromkeys(CATEGORIES, 0.0)
    for event in events:
        if getattr(event, "device_type", DeviceType.CPU) != DeviceType.CPU:
            continue  # a kernel's own event: its time is already its launching op's device time
        own = (event.self_device_time_total if cuda else event.self_cpu_time_total) / 1e6
        if own <= 0:
            continue
        ancestors, parent = [], event.cpu_parent
        while parent is not None:
            ancestors.append(parent.name)
            parent = parent.cpu_parent
        seconds[category_of(event.name, ancestors)] += own
    return seconds


def profile_step(
    run_step: Callable[[], Any],
    device: str,
    linear_flops: float | None = None,
    peak_flops_per_s: float | None = None,
) -> dict[str, Any]:
    """Run ``run_step`` once under the profiler; self seconds per category, their shares, and the
    GEMM rate (``linear_flops`` of that step over the matmul seconds, and over ``peak_flops_per_s``)."""
    cuda = device == "cuda"
    activities = [torch.profiler.ProfilerActivity.CPU]
    if cuda:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
        torch.cuda.synchronize()
    with torch.profiler.profile(activities=activities) as prof:
        run_step()
        if cuda:
            torch.cuda.synchronize()
    seconds = categorize(prof.events(), cuda=cuda)
    total = sum(seconds.values())
    found: dict[str, Any] = {
        "seconds": seconds,
        "total_s": total,
        "shares": {name: (value / total if total > 0 else 0.0) for name, value in seconds.items()},
        "timer": "device self time per kernel" if cuda else "CPU self time per op",
    }
    if linear_flops and seconds["matmul"] > 0:
        found["gemm_tflops"] = linear_flops / seconds["matmul"] / 1e12
        if peak_flops_per_s:
            found["gemm_fraction_of_peak"] = linear_flops / seconds["matmul"] / peak_flops_per_s
    return found
