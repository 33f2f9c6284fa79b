"""The ``slipstream_flex`` backend: ``flex_attention`` with a document-causal BlockMask (shared
prefixes and sliding windows included) built once per batch."""

from __future__ import annotations

import torch

from ..batch import PackedBatch
from .call import _NOT_GIVEN, _unpack_args
from .sdpa import packed_sdpa_attention


def flex_block_mask(batch: PackedBatch, window: int | None):
    """Document-causal (and windowed) BlockMask for the packed row, built once per batch."""

    def build():
        from torch.nn.attention.flex_attention import create_block_mask

        # per token, from the host lengths: where its document starts, and the shared prefix it
        # also sees (a range at the start of an earlier document, empty for most documents)
        starts, prefix_starts, prefix_ends = [], [], []
        for (start, end), span in zip(batch.doc_bounds(), batch.prefix_spans(), strict=True):
            length = end - start
            span = span or (start, start)
            starts += [start] * length
            prefix_starts += [span[0]] * length
            prefix_ends += [span[1]] * length
        doc_start = torch.tensor(starts, device=batch.device)
        prefix_start = torch.tensor(prefix_starts, device=batch.device)
        prefix_end = torch.tensor(prefix_ends, device=batch.device)
        # key positions as the document would number them alone (shared prompt first)
        offset = torch.tensor(
            [s - (pe - ps) for s, ps, pe in zip(starts, prefix_starts, prefix_ends, strict=True)],
            device=batch.device,
        )

        def mask_mod(b, h, q_idx, kv_idx):
            own = (kv_idx >= doc_start[q_idx]) & (kv_idx <= q_idx)
            shared = (kv_idx >= prefix_start[q_idx]) & (kv_idx < prefix_end[q_idx])
            allowed = own | shared
            if window is not None:
                # distance as the document alone numbers it: a shared key sits before its own keys
                q_alone = q_idx - offset[q_idx]
                k_alone = torch.where(own, kv_idx - offset[q_idx], kv_idx - prefix_start[q_idx])
                allowed = allowed & (k_alone > q_alone - window)
            return allowed

        T = batch.num_tokens
        return create_block_mask(mask_mod, B=None, H=None, Q_LEN=T, KV_LEN=T, device=batch.device)

    return batch.memo(("flex_block_mask", window), build)


def packed_flex_attention(
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
    """flex_attention with a BlockMask memoised on the batch (built once, used by every layer)."""
    query, batch, scaling, dropout, window, sinks = _unpack_args(
        module, query, key, attention_mask, kwargs, scaling, dropout, sliding_window
    )
    if batch is None or sinks is not None:
        return packed_sdpa_attention(
            module, query, key, value, attention_mask, scaling, dropout, sliding_window, **kwargs
        )
    from torch.nn.attention.flex_attention import flex_attention

    out = flex_attention(
        query,
        key,
        value,
        block_mask=flex_block_mask(batch, window),
        scale=scaling,
        enable_gqa=query.shape[1] != key.shape[1],
    )
    return out.transpose(1, 2).contiguous(), None
