"""The ``slipstream_varlen`` backend: one varlen flash-attention call over the whole packed row
(``torch.nn.attention.varlen.varlen_attn``, or flash-attn's ``flash_attn_varlen_func``), CUDA only;
a row with shared prefixes takes :mod:`.prefixed_varlen`'s two calls, or per-document SDPA."""

from __future__ import annotations

from collections.abc import Callable

import torch

from ...refusal import optimize_call
from ..batch import PackedBatch
from .call import _NOT_GIVEN, _SDPA, UnsupportedAttentionFeature, _unpack_args
from .prefixed_varlen import _varlen_ops, _varlen_params, prefixed_varlen_attention
from .sdpa import packed_sdpa_attention


def varlen_kernel() -> tuple[str, Callable] | None:
    """The varlen flash kernel available here, if any: torch's own first, then flash-attn."""
    if not torch.cuda.is_available():
        return None
    try:
        from torch.nn.attention.varlen import varlen_attn

        return "torch.varlen_attn", varlen_attn
    except ImportError:
        pass
    try:
        from flash_attn import flash_attn_varlen_func

        return "flash_attn", flash_attn_varlen_func
    except ImportError:
        return None


def packed_varlen_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = _NOT_GIVEN,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """One varlen flash-attention call over the whole packed row, reading the batch's cu_seqlens."""
    query, batch, scaling, dropout, window, sinks = _unpack_args(
        module, query, key, attention_mask, kwargs, scaling, dropout, sliding_window
    )
    if batch is None or sinks is not None or query.device.type != "cuda":
        return packed_sdpa_attention(
            module, query, key, value, attention_mask, scaling, dropout, sliding_window, **kwargs
        )
    kernel = varlen_kernel()
    if kernel is None:
        raise RuntimeError("slipstream_varlen needs CUDA and torch.nn.attention.varlen or flash-attn")
    name, fn = kernel
    if batch.has_prefixes:
        # shared prefixes (pairs, groups): two varlen calls merged by their log-sum-exp where torch's
        # kernel is here and no window cuts a sequence; else per-document SDPA, each with its prefix
        if name != "torch.varlen_attn" or _varlen_ops() is None or window_cuts(batch, window):
            return packed_sdpa_attention(
                module, query, key, value, attention_mask, scaling, dropout, sliding_window, **kwargs
            )
        return prefixed_varlen_attention(query, key, value, batch, scaling), None
    q_THD = query[0].transpose(0, 1)
    k_THD = key[0].transpose(0, 1)
    v_THD = value[0].transpose(0, 1)
    left = -1 if window is None else window - 1
    if name == "torch.varlen_attn":
        params = _varlen_params(fn)
        extra = {}
        if "window_size" in params:
            extra["window_size"] = (left, 0)
        elif window is not None:
            raise UnsupportedAttentionFeature(
                f"this torch's varlen_attn has no sliding window; use backend 'sdpa': {optimize_call(_SDPA)}",
                refused="a sliding window on this torch's varlen_attn",
                avoid=_SDPA,
            )
        else:
            extra["is_causal"] = True
        if "enable_gqa" in params:
            extra["enable_gqa"] = query.shape[1] != key.shape[1]
        elif query.shape[1] != key.shape[1]:
            groups = query.shape[1] // key.shape[1]
            k_THD = k_THD.repeat_interleave(groups, dim=1)
            v_THD = v_THD.repeat_interleave(groups, dim=1)
        extra["scale"] = scaling
    else:  # flash-attn's varlen kernel names its arguments its own way
        extra = dict(dropout_p=dropout, softmax_scale=scaling, causal=True, window_size=(left, 0))
    cu, longest = batch.cu_seqlens, batch.max_seqlen
    out_THD = fn(q_THD, k_THD, v_THD, cu, cu, longest, longest, **extra)
    return out_THD.unsqueeze(0), None


def window_cuts(batch: PackedBatch, window: int | None) -> bool:
    """A sliding window shorter than some sequence as it runs alone (prefix + own tokens)."""
    return window is not None and window < max(batch.alone_lengths)
