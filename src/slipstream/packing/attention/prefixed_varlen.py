"""Varlen attention for a row with shared prefixes or a prefix tree: two calls of torch's varlen kernel
(each document over its own tokens; the prefixed documents over their prefix's, or ancestors', keys) merged by their log-sum-exps,
with the backward written out (the kernel drops the log-sum-exp's gradient)."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch

from ..batch import PackedBatch, cumulative, host_tensor


def _varlen_ops() -> tuple[Callable, Callable] | None:
    """torch's varlen forward (returning the log-sum-exp) and backward ops, if this torch has them."""
    try:
        import torch.nn.attention.varlen  # noqa: F401 - registers the torch_attn ops
    except ImportError:
        return None
    ops = getattr(torch.ops, "torch_attn", None)
    forward = getattr(ops, "_varlen_attn", None) if ops is not None else None
    backward = getattr(ops, "_varlen_attn_backward", None) if ops is not None else None
    return None if forward is None or backward is None else (forward, backward)


def _op_kwargs(op: Callable, **wanted: Any) -> dict[str, Any]:
    """The keyword arguments of ``wanted`` that ``op``'s schema takes (the varlen ops' signatures grew
    across torch releases); a plain function (a test's stand-in) takes them all. Causality is the
    ``is_causal`` flag, so no window is passed: call 1 is causal, call 2 sees every prefix key."""
    schema = getattr(getattr(op, "default", None), "_schema", None)
    if schema is None:
        return wanted
    names = {argument.name for argument in schema.arguments}
    return {key: value for key, value in wanted.items() if key in names}


class PrefixPlan:
    """What the second varlen call of a row with shared prefixes reads, built once per batch on the
    host: the row positions of every query that has a prefix (its document's tokens, concatenated)
    and of the prefix keys each such document sees (repeated per document), their cu_seqlens and
    maxima. Moved to the batch's device once (pinned, non-blocking)."""

    def __init__(self, batch: PackedBatch):
        query_rows: list[int] = []
        key_rows: list[int] = []
        q_lens: list[int] = []
        k_lens: list[int] = []
        for (start, end), spans in zip(batch.doc_bounds(), batch.context_spans(), strict=True):
            if not spans:
                continue
            query_rows += range(start, end)
            for span in spans:  # a tree node's ancestors, root first: its row's keys before its own
                key_rows += range(*span)
            q_lens.append(end - start)
            k_lens.append(sum(e - s for s, e in spans))
        device = batch.device
        self.query_rows = host_tensor(query_rows, device)
        self.key_rows = host_tensor(key_rows, device)
        self.cu_q = host_tensor(cumulative(q_lens), device, torch.int32)
        self.cu_k = host_tensor(cumulative(k_lens), device, torch.int32)
        self.max_q, self.max_k = max(q_lens), max(k_lens)

    @staticmethod
    def of(batch: PackedBatch) -> PrefixPlan:
        return batch.memo("prefix_plan", lambda: PrefixPlan(batch))


class _PrefixedVarlen(torch.autograd.Function):
    """Varlen attention for a row with shared prefixes, in two kernel calls and no per-document loop.

    Call 1: every document causal over its own tokens (the row's cu_seqlens). Call 2: the queries of
    every document with a prefix, non-causal over its prefix's keys. Their outputs merge by the
    log-sum-exps: ``out = (o1 e^lse1 + o2 e^lse2) / (e^lse1 + e^lse2)``. The kernel's backward drops
    a gradient of its log-sum-exp, so the backward is written here, as ring attention's: each call's
    backward runs with the *merged* output and log-sum-exp, which makes its softmax the merged one;
    the prefix keys' gradients are added back to their rows.
    """

    @staticmethod
    def forward(ctx, q_THD, k_THD, v_THD, batch, scale, enable_gqa):
        forward_op, _ = _varlen_ops()
        plan = PrefixPlan.of(batch)
        n = batch.max_seqlen
        extra = _op_kwargs(forward_op, scale=scale, enable_gqa=enable_gqa)
        out1, lse1_HT, rng1 = forward_op(
            q_THD, k_THD, v_THD, batch.cu_seqlens, batch.cu_seqlens, n, n, True, **extra
        )
        q2 = q_THD.index_select(0, plan.query_rows)
        k2 = k_THD.index_select(0, plan.key_rows)
        v2 = v_THD.index_select(0, plan.key_rows)
        out2, lse2_HQ, rng2 = forward_op(
            q2, k2, v2, plan.cu_q, plan.cu_k, plan.max_q, plan.max_k, False, **extra
        )
        lse1_HQ = lse1_HT.index_select(1, plan.query_rows)
        lse_HQ = torch.logaddexp(lse1_HQ, lse2_HQ)
        w1_QH1 = torch.exp(lse1_HQ - lse_HQ).transpose(0, 1).unsqueeze(-1)
        w2_QH1 = torch.exp(lse2_HQ - lse_HQ).transpose(0, 1).unsqueeze(-1)
        fp = torch.promote_types(out1.dtype, torch.float32)  # the merge in fp32 at least
        merged = out1.index_select(0, plan.query_rows).to(fp) * w1_QH1 + out2.to(fp) * w2_QH1
        out = out1.index_copy(0, plan.query_rows, merged.to(out1.dtype))
        lse_HT = lse1_HT.index_copy(1, plan.query_rows, lse_HQ)
        ctx.save_for_backward(q_THD, k_THD, v_THD, out, lse_HT, rng1, rng2)
        ctx.batch, ctx.scale = batch, scale
        return out

    @staticmethod
    def backward(ctx, grad_THD):
        _, backward_op = _varlen_ops()
        q_THD, k_THD, v_THD, out, lse_HT, rng1, rng2 = ctx.saved_tensors
        batch, scale = ctx.batch, ctx.scale
        plan = PrefixPlan.of(batch)
        grad_THD = grad_THD.contiguous()
        n = batch.max_seqlen
        extra = _op_kwargs(backward_op, scale=scale)
        dq, dk, dv = backward_op(
            grad_THD, q_THD, k_THD, v_THD, out, lse_HT, batch.cu_seqlens, batch.cu_seqlens, n, n, True, rng1,
            **extra,
        )  # fmt: skip
        rows, keys = plan.query_rows, plan.key_rows
        dq2, dk2, dv2 = backward_op(
            grad_THD.index_select(0, rows), q_THD.index_select(0, rows), k_THD.index_select(0, keys),
            v_THD.index_select(0, keys), out.index_select(0, rows), lse_HT.index_select(1, rows).contiguous(),
            plan.cu_q, plan.cu_k, plan.max_q, plan.max_k, False, rng2, **extra,
        )  # fmt: skip
        # a prefix key is read by every document of its group: its rows of dk2 / dv2 (one per reader)
        # are summed in fp32 and rounded once (a bf16 index_add rounds after every addition)
        return _add_rows(dq, rows, dq2), _add_rows(dk, keys, dk2), _add_rows(dv, keys, dv2), None, None, None


def _add_rows(into: torch.Tensor, rows: torch.Tensor, extra: torch.Tensor) -> torch.Tensor:
    """``into`` with ``extra``'s rows added at ``rows`` (repeats summed), in fp32 at least, cast back."""
    wide = torch.promote_types(into.dtype, torch.float32)
    return into.to(wide).index_add_(0, rows, extra.to(wide)).to(into.dtype)


def prefixed_varlen_attention(query, key, value, batch: PackedBatch, scaling: float) -> torch.Tensor:
    """query [1, H, T, D], key / value [1, Hkv, T, D] -> [1, T, H, D]: every document causal over its
    own tokens and, where it has one, over its shared prefix (:class:`_PrefixedVarlen`)."""
    q_THD = query[0].transpose(0, 1)
    k_THD = key[0].transpose(0, 1)
    v_THD = value[0].transpose(0, 1)
    from torch.nn.attention.varlen import varlen_attn

    enable_gqa = query.shape[1] != key.shape[1]
    if enable_gqa and "enable_gqa" not in _varlen_params(varlen_attn):
        groups = query.shape[1] // key.shape[1]
        k_THD = k_THD.repeat_interleave(groups, dim=1)
        v_THD = v_THD.repeat_interleave(groups, dim=1)
        enable_gqa = False
    return _PrefixedVarlen.apply(q_THD, k_THD, v_THD, batch, scaling, enable_gqa).unsqueeze(0)


@functools.cache
def _varlen_params(fn: Callable) -> frozenset[str]:
    """The keyword names this torch's varlen_attn takes (its signature changed across releases)."""
    return frozenset(inspect.signature(fn).parameters)
