"""Which packed backend runs: the backends' names, their registration with transformers'
``AttentionInterface`` (wrapped for compiled layers), and ``choose_backend``'s policy for
``attention_backend`` ("auto": varlen on CUDA in fp16 / bf16, per-document SDPA otherwise)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Literal, get_args

import torch

from ...refusal import Refusal
from . import varlen
from .flex import packed_flex_attention
from .sdpa import packed_sdpa_attention
from .varlen import packed_varlen_attention

# The packed-attention backends, defined once (Speedups and the CLIs read them).
AttentionBackend = Literal["auto", "sdpa", "varlen", "flex"]
BACKENDS = tuple(b for b in get_args(AttentionBackend) if b != "auto")


class AttentionBackendUnavailable(Refusal, ValueError):
    """An ``attention_backend`` asked for by name that cannot run here (the device, the dtype)."""

    avoid = {"attention_backend": "auto"}


# transformers runs its own SDPA / flex capability checks on any name containing "sdpa" or
# "flex_attention" (and refuses GPT-OSS for them), so the registered names avoid both.
ATTENTION_FUNCTIONS: dict[str, Callable] = {
    "slipstream_docwise": packed_sdpa_attention,
    "slipstream_varlen": packed_varlen_attention,
    "slipstream_flex": packed_flex_attention,
}


BACKEND_NAMES = {"sdpa": "slipstream_docwise", "varlen": "slipstream_varlen", "flex": "slipstream_flex"}


def register_attention_functions(outside_graphs: bool = False) -> None:
    """Register the packed backends with transformers (idempotent).

    No mask function is registered on purpose: for an attention name without one,
    transformers' mask builders return ``None`` straight away, before they would inspect
    position_ids (a host sync) or build a dense [B, 1, T, T] mask.

    ``outside_graphs``: register them wrapped in ``torch.compiler.disable``, for compiled decoder
    layers (``slipstream.compile``): the per-document loop over the batch's host lengths then runs
    eagerly between two graphs, so no graph specializes on a batch's document count. Once
    registered so they stay so (the wrapper is the same function to an eager caller).
    """
    from transformers import AttentionInterface

    global _OUTSIDE_GRAPHS
    _OUTSIDE_GRAPHS = _OUTSIDE_GRAPHS or outside_graphs
    for name, fn in ATTENTION_FUNCTIONS.items():
        AttentionInterface.register(name, _disabled(fn) if _OUTSIDE_GRAPHS else fn)


_OUTSIDE_GRAPHS = False


@functools.cache
def _disabled(fn: Callable) -> Callable:
    """``fn`` run eagerly between two compiled graphs (``slipstream.compile``). Its output crosses
    into the next graph, which dynamo guards on, and it guards a view on its base's sizes: an output
    that is a view for one batch (one document: SDPA's output transposed back; varlen's ``unsqueeze``)
    and a fresh tensor for the next (several documents, grouped) rebuilt that graph mid-run. So a view
    is handed over as a fresh copy (one [T, H, D] copy, only where compiled layers run): every batch,
    whatever its path, gives the graph the same kind of tensor."""

    @torch.compiler.disable
    @functools.wraps(fn)
    def outside_graphs(*args, **kwargs):
        out, weights = fn(*args, **kwargs)
        if out._is_view():
            out = out.clone(memory_format=torch.contiguous_format)
        return out, weights

    return outside_graphs


VARLEN_DTYPES = (torch.float16, torch.bfloat16)  # the varlen kernels are flash attention's


def choose_backend(
    requested: str, device: torch.device, has_sinks: bool, dtype: torch.dtype | None = None
) -> tuple[str, str]:
    """Pick a backend for ``requested`` ("auto" or one of BACKENDS); returns (backend, reason).

    ``dtype``: the attention inputs' dtype (the model's). The varlen kernels run fp16 / bf16 only,
    so "auto" keeps an fp32 model on per-document SDPA and an explicit "varlen" is refused.
    """
    if requested not in ("auto", *BACKENDS):
        raise ValueError(f"attention_backend must be 'auto' or one of {BACKENDS}, got {requested!r}")
    if requested != "auto":
        if requested == "varlen" and varlen.varlen_kernel() is None:
            raise AttentionBackendUnavailable(
                "attention_backend='varlen' needs CUDA and torch.nn.attention.varlen or flash-attn",
                refused="attention_backend='varlen' without its kernel",
            )
        if requested == "varlen" and dtype is not None and dtype not in VARLEN_DTYPES:
            raise AttentionBackendUnavailable(
                f"attention_backend='varlen' runs float16 / bfloat16 only (flash attention), not "
                f"{str(dtype).removeprefix('torch.')}: use 'sdpa' or 'auto'",
                refused=f"attention_backend='varlen' for a {str(dtype).removeprefix('torch.')} model",
            )
        return requested, "requested"
    if device.type == "cuda":
        kernel = varlen.varlen_kernel()
        if kernel is not None and not has_sinks and dtype is not None and dtype not in VARLEN_DTYPES:
            return "sdpa", (
                f"{str(dtype).removeprefix('torch.')} model: per-document SDPA (the varlen kernels "
                "run float16 / bfloat16 only)"
            )
        if kernel is not None and not has_sinks:
            return "varlen", f"CUDA with {kernel[0]}"
        if has_sinks:
            return "sdpa", "attention sinks: per-document path (no fused varlen kernel has sinks)"
        return "sdpa", "CUDA without a varlen kernel"
    return "sdpa", f"{device.type}: per-document SDPA"
