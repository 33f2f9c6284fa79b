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

        if batch.parents is not None:
            return create_block_mask(
                _tree_mask_mod(batch, window), B=None, H=None, Q_LEN=batch.num_tokens, KV_LEN=batch.num_tokens,
                device=batch.device,
            )  # fmt: skip
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


def _tree_mask_mod(batch: PackedBatch, window: int | None):
    """A prefix tree's mask (:mod:`..trees`): a key is visible to a query in its own document causally,
    and in any document whose subtree holds the query's (an ancestor: pre-order makes a subtree the
    documents from the node to ``subtree_ends``). Positions continue from the parent's end, so the
    window compares position_ids, the positions the query's row run alone gives. O(T) host metadata."""
    doc_of = []
    for number, length in enumerate(batch.seq_lens):
        doc_of += [number] * length
    doc = torch.tensor(doc_of, device=batch.device)
    subtree_end = torch.tensor(batch.subtree_ends(), device=batch.device)
    positions = batch.position_ids[0]

    def mask_mod(b, h, q_idx, kv_idx):
        q_doc, kv_doc = doc[q_idx], doc[kv_idx]
        own = (q_doc == kv_doc) & (kv_idx <= q_idx)
        ancestor = (kv_doc < q_doc) & (q_doc < subtree_end[kv_doc])
        allowed = own | ancestor
        if window is not None:
            allowed = allowed & (positions[kv_idx] > positions[q_idx] - window)
        return allowed

    return mask_mod


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
