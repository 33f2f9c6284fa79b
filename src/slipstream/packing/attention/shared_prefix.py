"""Shared context (a pair's prompt, a group's prefix, a tree node's ancestors) on the per-document paths:
which documents read which source document's first tokens, and the autograd node that hands them those
keys / values and sums their gradients in fp32."""

from __future__ import annotations

import torch

from ..batch import PackedBatch


def prefix_readers(batch: PackedBatch) -> dict[int, tuple[tuple[int, int], ...]]:
    """Per source document, the documents that attend to its first tokens as shared context and how
    many each reads: ``{source: ((document, tokens), ...)}`` ({} without prefixes). Host ints,
    memoised on the batch."""

    def build() -> dict[int, tuple[tuple[int, int], ...]]:
        found: dict[int, list[tuple[int, int]]] = {}
        for number, sources in enumerate(batch.context_sources()):
            for source, n in sources:
                found.setdefault(source, []).append((number, n))
        return {source: tuple(docs) for source, docs in found.items()}

    return batch.memo("prefix_readers", build) if batch.has_prefixes else {}


def _share_prefixes(parts, readers, batch: PackedBatch):
    """``parts`` (one document's keys or values each, ``[1, Hkv, L, D]``) with every source document
    routed through :class:`_SharedPrefix`; returns them and ``{document: [its context's slices, in
    order]}``."""
    parts = list(parts)
    sliced: dict[tuple[int, int], torch.Tensor] = {}  # (source, reader) -> the slice it reads
    for source, docs in readers.items():
        whole, *slices = _SharedPrefix.apply(parts[source], tuple(n for _, n in docs))
        parts[source] = whole
        sliced.update({(source, number): piece for (number, _), piece in zip(docs, slices, strict=True)})
    contexts = {
        number: [sliced[(source, number)] for source, _ in sources]
        for number, sources in enumerate(batch.context_sources())
        if sources
    }
    return parts, contexts


class _SharedPrefix(torch.autograd.Function):
    """One document's keys (or values), ``[1, Hkv, L, D]``, handed to its own attention and, sliced,
    to every document that attends to them as a shared prefix: ``(whole, prefix_1, ..., prefix_n)``.

    The prefix's gradient is the sum of its N readers'. Left to autograd, that sum is accumulated
    one reader at a time in the model's dtype, rounding after every addition: in bf16 its error
    grows with N (~sqrt(N) times one rounding: 0.66% at N = 40, 2% at N = 300 against 0.18% summed
    in fp32), in every layer, where the unshared rows sum the same N gradients inside the
    projections' GEMMs (fp32 accumulation, one rounding). Here the readers' gradients are summed
    in fp32 and rounded once. Forward: views, no copy."""

    @staticmethod
    def forward(ctx, whole: torch.Tensor, lengths: tuple[int, ...]):
        ctx.lengths = lengths
        ctx.shape, ctx.dtype = whole.shape, whole.dtype
        ctx.set_materialize_grads(False)
        return (whole.view_as(whole), *(whole[:, :, :n] for n in lengths))

    @staticmethod
    def backward(ctx, grad_whole, *grad_prefixes):
        if all(g is None for g in grad_prefixes):
            return grad_whole, None
        wide = torch.promote_types(ctx.dtype, torch.float32)
        like = next(g for g in grad_prefixes if g is not None)
        if grad_whole is None:
            total = torch.zeros(ctx.shape, dtype=wide, device=like.device)
        else:
            total = grad_whole.to(wide, copy=True)
        for n, grad in zip(ctx.lengths, grad_prefixes, strict=True):
            if grad is not None:
                total[:, :, :n] += grad
        return total.to(ctx.dtype), None


_CPU_FLASH = "_scaled_dot_product_flash_attention_for_cpu"


def cpu_context_attention(query, context_keys, context_values, key, value, scaling, window, batch):
    """One document's SDPA over its shared context then its own keys, on a CPU, without keeping the
    context's concatenated keys and values for the backward: :class:`_ContextAttention`. None where
    this torch lacks the CPU flash op (the caller concatenates as before)."""
    ops = torch.ops.aten
    if not hasattr(ops, _CPU_FLASH) or not hasattr(ops, _CPU_FLASH + "_backward"):
        return None
    from .documents import _doc_mask

    q_len = query.shape[-2]
    k_len = q_len + sum(part.shape[-2] for part in context_keys)
    mask = batch.memo(
        ("additive_mask", q_len, k_len, window, query.dtype, str(query.device)),
        lambda: torch.zeros(q_len, k_len, dtype=query.dtype, device=query.device).masked_fill(
            ~_doc_mask(batch, q_len, window, query.device, k_len), float("-inf")
        ),
    )
    n = len(context_keys)
    return _ContextAttention.apply(query, mask, scaling, n, *context_keys, key, *context_values, value)


class _ContextAttention(torch.autograd.Function):
    """SDPA (the CPU flash kernel SDPA dispatches to, bit for bit) of one document's queries over its
    context's keys and values then its own, joined here: the forward keeps the parts (views of the
    layer's keys and values, no copy) and the kernel's log-sum-exp, and the backward joins them again.
    A tree node's ancestors, joined and kept for every node, made a tree's activations larger than the
    rows' whole; this keeps each layer's keys once."""

    @staticmethod
    def forward(ctx, query, mask, scale, n, *parts):
        keys, values = parts[: n + 1], parts[n + 1 :]
        out, lse = getattr(torch.ops.aten, _CPU_FLASH)(
            query, torch.cat(keys, dim=2), torch.cat(values, dim=2), 0.0, False, attn_mask=mask, scale=scale
        )[:2]
        ctx.save_for_backward(query, mask, out, lse, *parts)
        ctx.scale, ctx.n = scale, n
        return out

    @staticmethod
    def backward(ctx, grad_out):
        query, mask, out, lse, *parts = ctx.saved_tensors
        n = ctx.n
        keys, values = parts[: n + 1], parts[n + 1 :]
        dq, dk, dv = getattr(torch.ops.aten, _CPU_FLASH + "_backward")(
            grad_out.contiguous(), query, torch.cat(keys, dim=2), torch.cat(values, dim=2), out, lse, 0.0, False,
            attn_mask=mask, scale=ctx.scale,
        )  # fmt: skip
        sizes = [part.shape[-2] for part in keys]
        return (dq, None, None, None, *dk.split(sizes, dim=2), *dv.split(sizes, dim=2))
