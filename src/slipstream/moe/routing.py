"""Group an MoE layer's (token, expert) pairs by expert once, with no host sync.

A stable argsort of the flattened expert ids puts every expert's pairs in one contiguous
slice; the per-expert counts and their cumulative offsets say where each slice starts.
transformers' eager experts instead run ``where``/``nonzero`` once per expert, a host sync
each. The counts are computed with ``scatter_add`` rather than ``torch.bincount``, whose
CUDA kernel reads the maximum id back to size its output (a sync); the result is the same.

The row permutations are autograd Functions whose backward is the inverse permutation (a
gather), instead of the scatter-add that indexing's backward would run: the same numbers,
no atomics, and cheaper on CPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ExpertGroups:
    """The (token, k) pairs of a layer, sorted by expert. S = tokens x top_k."""

    order_S: torch.Tensor  # position in the flattened [T*K] pairs of each sorted pair
    inverse_S: torch.Tensor  # where each flattened pair went in the sorted order
    expert_ids_S: torch.Tensor  # expert of each sorted pair (non-decreasing)
    counts_E: torch.Tensor  # pairs per expert, int32 on the device
    offsets_E: torch.Tensor  # cumsum(counts), int32: end of each expert's slice
    top_k: int


def group_by_expert(expert_ids_TK: torch.Tensor, num_experts: int) -> ExpertGroups:
    """Sort the flattened ``[T, K]`` expert ids once; see the module docstring."""
    flat_S = expert_ids_TK.reshape(-1)
    order_S = torch.argsort(flat_S, stable=True)
    inverse_S = torch.empty_like(order_S)
    inverse_S.scatter_(0, order_S, torch.arange(order_S.numel(), device=order_S.device))
    counts_E = torch.zeros(num_experts, dtype=torch.int32, device=flat_S.device)
    counts_E.scatter_add_(0, flat_S, torch.ones_like(flat_S, dtype=torch.int32))
    return ExpertGroups(
        order_S=order_S,
        inverse_S=inverse_S,
        expert_ids_S=flat_S.index_select(0, order_S),
        counts_E=counts_E,
        offsets_E=torch.cumsum(counts_E, 0, dtype=torch.int32),
        top_k=expert_ids_TK.shape[-1],
    )


class _GatherRows(torch.autograd.Function):
    """``rows[index]`` for a permutation ``index``; backward gathers with the inverse."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, index: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(inverse)
        return rows.index_select(0, index)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (inverse,) = ctx.saved_tensors
        return grad.index_select(0, inverse), None, None


class _GatherTokens(torch.autograd.Function):
    """``hidden[token_S]``: each token once per expert it was routed to, in expert order.

    Backward puts the rows back in (token, k) order with the inverse permutation and sums
    over k: the gradient of every copy, added without a scatter-add.
    """

    @staticmethod
    def forward(ctx, hidden_TH: torch.Tensor, token_S: torch.Tensor, inverse_S: torch.Tensor, top_k: int):
        ctx.save_for_backward(inverse_S)
        ctx.top_k = top_k
        return hidden_TH.index_select(0, token_S)

    @staticmethod
    def backward(ctx, grad_SH: torch.Tensor):
        (inverse_S,) = ctx.saved_tensors
        pairs = grad_SH.index_select(0, inverse_S)
        return pairs.view(-1, ctx.top_k, pairs.shape[-1]).sum(dim=1), None, None, None


def tokens_in_expert_order(hidden_TH: torch.Tensor, groups: ExpertGroups) -> torch.Tensor:
    """``[S, H]``: each token's hidden state once per expert it was routed to, sorted by expert."""
    token_S = torch.div(groups.order_S, groups.top_k, rounding_mode="floor")
    return _GatherTokens.apply(hidden_TH, token_S, groups.inverse_S, groups.top_k)


def combine_top_k(out_SH: torch.Tensor, weights_TK: torch.Tensor, groups: ExpertGroups) -> torch.Tensor:
    """Weight each sorted output by its routing weight, restore token order, sum over k.

    A plain sum over k (no index_add, no atomics), so the result is deterministic.
    """
    weights_S = weights_TK.reshape(-1).index_select(0, groups.order_S)
    weighted_SH = out_SH * weights_S.unsqueeze(-1).to(out_SH.dtype)
    pairs_SH = _GatherRows.apply(weighted_SH, groups.inverse_S, groups.order_S)
    T = weights_TK.shape[0]
    return pairs_SH.view(T, groups.top_k, -1).sum(dim=1)
