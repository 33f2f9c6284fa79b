"""Attention over one document (or one unpacked row), ``[B, H, L, D]`` in and out: SDPA (or the
short-document kernel, :mod:`..short_attention`), the eager path with attention sinks, and the
small causal / window masks they need, memoised on the batch."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..batch import PackedBatch
from ..costs import BUILTIN
from ..short_attention import short_causal_attention, takes_short_kernel


def _window_allowed(q_len: int, k_len: int, window: int | None, device: torch.device) -> torch.Tensor:
    """Boolean [q_len, k_len] mask: causal (aligned to the end of the keys) and, if set, a window.

    Same semantics as transformers: key j is visible to query i when j <= i and j > i - window.
    Only ever built per document (or per decode step), never for the whole packed row.
    """
    q_pos = torch.arange(k_len - q_len, k_len, device=device).unsqueeze(1)
    k_pos = torch.arange(k_len, device=device).unsqueeze(0)
    allowed = k_pos <= q_pos
    if window is not None:
        allowed = allowed & (k_pos > q_pos - window)
    return allowed


def _doc_mask(
    batch: PackedBatch | None, length: int, window: int | None, device, k_len: int | None = None
) -> torch.Tensor:
    """A document's causal / window mask, memoised on the batch (one build per shape per batch).
    ``k_len`` > ``length``: a document that also attends to a shared prefix (:mod:`.pairs`)."""
    k_len = length if k_len is None else k_len
    if batch is None:
        return _window_allowed(length, k_len, window, device)
    return batch.memo(
        ("window_mask", length, k_len, window, str(device)),
        lambda: _window_allowed(length, k_len, window, device),
    )


def _sdpa_one(query, key, value, scaling, dropout, window, batch, short_kernel="off", costs=BUILTIN):
    """SDPA over one document (or one unpacked row): [B, H, L, D] in, [B, H, L, D] out.
    ``short_kernel``: the :mod:`.short_attention` mode (``costs``: its measured reach); a short
    document it takes runs there."""
    if takes_short_kernel(query, key, dropout, short_kernel, costs):
        return short_causal_attention(query, key, value, scaling, window, batch)
    q_len, k_len = query.shape[-2], key.shape[-2]
    enable_gqa = query.shape[1] != key.shape[1]
    if window is None or k_len <= window:
        if q_len == k_len:
            return F.scaled_dot_product_attention(
                query, key, value, is_causal=True, dropout_p=dropout, scale=scaling, enable_gqa=enable_gqa
            )
        if q_len == 1:
            return F.scaled_dot_product_attention(
                query, key, value, dropout_p=dropout, scale=scaling, enable_gqa=enable_gqa
            )
    mask = _doc_mask(batch, q_len, window, query.device, k_len)
    return F.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, dropout_p=dropout, scale=scaling, enable_gqa=enable_gqa
    )


def _sinks_one(module, query, key, value, scaling, dropout, window, sinks, batch):
    """Eager attention with per-head sink logits over one document: [B, H, L, D] in and out.

    The sink is an extra logit per head that takes part in the softmax and is then dropped,
    as in GPT-OSS. Computed in the query's dtype, like the stock eager path.
    """
    q_len, k_len = query.shape[-2], key.shape[-2]
    groups = query.shape[1] // key.shape[1]
    if groups > 1:
        key = key.repeat_interleave(groups, dim=1)
        value = value.repeat_interleave(groups, dim=1)
    scores = torch.matmul(query, key.transpose(-1, -2)) * scaling
    allowed = _doc_mask(batch, q_len, window, query.device, k_len)
    scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
    sink_logits = sinks.reshape(1, -1, 1, 1).expand(query.shape[0], -1, q_len, 1).to(scores.dtype)
    logits = torch.cat([scores, sink_logits], dim=-1)
    logits = logits - logits.max(dim=-1, keepdim=True).values
    probs = torch.softmax(logits, dim=-1)[..., :-1]
    probs = F.dropout(probs, p=dropout, training=module.training).to(value.dtype)
    return torch.matmul(probs, value)
