"""The varlen path for shared prefixes (two kernel calls merged by log-sum-exp, ring-attention
backward) against per-document SDPA, on the CPU: torch's varlen ops are CUDA-only, so a reference
of their exact contract stands in (forward: out and lse [H, T]; backward: flash attention's, from
the output and lse it is given)."""

from __future__ import annotations

import functools

import pytest
import torch

from slipstream.packing.attention import _per_document, _sdpa_one, prefixed_varlen_attention
from slipstream.packing.attention import prefixed_varlen as attention
from slipstream.packing.groups import collate_groups
from slipstream.packing.pairs import collate_pairs


def _spans(cu: torch.Tensor) -> list[tuple[int, int]]:
    bounds = cu.tolist()
    return list(zip(bounds[:-1], bounds[1:], strict=True))


def _scores(q, k, scale, is_causal):
    """[H, Lq, Lk] logits and the allowed mask (causal aligned to the keys' end, as flash attention)."""
    s = q.transpose(0, 1) @ k.transpose(0, 1).transpose(-1, -2) * scale
    lq, lk = q.shape[0], k.shape[0]
    allowed = torch.ones(lq, lk, dtype=torch.bool)
    if is_causal:
        allowed = torch.arange(lk).unsqueeze(0) <= torch.arange(lq).unsqueeze(1) + (lk - lq)
    return s.masked_fill(~allowed, float("-inf")), allowed


def reference_forward(q, k, v, cu_q, cu_k, max_q, max_k, is_causal, scale=None, enable_gqa=False):
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    outs, lses = [], []
    for (qs, qe), (ks, ke) in zip(_spans(cu_q), _spans(cu_k), strict=True):
        s, _ = _scores(q[qs:qe], k[ks:ke], scale, is_causal)
        lses.append(s.logsumexp(-1))
        outs.append((s.softmax(-1) @ v[ks:ke].transpose(0, 1)).transpose(0, 1))
    return torch.cat(outs), torch.cat(lses, dim=1), torch.zeros(2)


def reference_backward(g, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, is_causal, rng, scale=None):
    hkv = k.shape[1]
    groups = q.shape[1] // hkv
    kr, vr = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(kr), torch.zeros_like(vr)
    for (qs, qe), (ks, ke) in zip(_spans(cu_q), _spans(cu_k), strict=True):
        s, allowed = _scores(q[qs:qe], kr[ks:ke], scale, is_causal)
        p = torch.exp(s - lse[:, qs:qe].unsqueeze(-1)) * allowed  # softmax as the given lse normalises it
        g_h, o_h = g[qs:qe].transpose(0, 1), out[qs:qe].transpose(0, 1)
        dv[ks:ke] += (p.transpose(-1, -2) @ g_h).transpose(0, 1)
        dp = g_h @ vr[ks:ke].transpose(0, 1).transpose(-1, -2)
        ds = p * (dp - (g_h * o_h).sum(-1, keepdim=True))
        dq[qs:qe] += (ds @ kr[ks:ke].transpose(0, 1)).transpose(0, 1) * scale
        dk[ks:ke] += (ds.transpose(-1, -2) @ q[qs:qe].transpose(0, 1)).transpose(0, 1) * scale
    t = k.shape[0]
    return dq, dk.view(t, hkv, groups, -1).sum(2), dv.view(t, hkv, groups, -1).sum(2)


def groups_batch():
    generator = torch.Generator().manual_seed(0)

    def ids(n):
        return torch.randint(1, 100, (n,), generator=generator).tolist()

    groups = [
        {"prefix_ids": ids(9), "continuations": [{"input_ids": ids(n)} for n in (3, 1, 6, 2, 7, 4, 5, 2)]},
        {"prefix_ids": [], "continuations": [{"input_ids": ids(5)}]},
        {"prefix_ids": ids(4), "continuations": [{"input_ids": ids(3)}, {"input_ids": ids(8)}]},
    ]
    return collate_groups(groups)


def tree_batch():
    """A prefix tree of depth 4: cousins, a row ending at an inner node, and a lone row."""
    from slipstream.data.prefix_tree import tree_items
    from slipstream.packing.trees import collate_trees

    ids = list(range(1, 60))
    spine = [ids[:5], ids[5:9], ids[9:12], ids[12:18]]
    rows = [
        sum(spine, []),
        sum(spine[:3], []) + ids[20:24],
        sum(spine[:2], []) + ids[24:27],
        sum(spine[:2], []),
        spine[0] + ids[30:33] + ids[33:35],
        spine[0] + ids[30:33] + ids[40:44],
        ids[50:56],
    ]
    trees, _ = tree_items([{"input_ids": r, "labels": r} for r in rows], 128, min_shared=1)
    return collate_trees(trees)


def pairs_batch():
    return collate_pairs(
        [
            {"prompt_ids": [1, 2, 3, 4, 5], "chosen_ids": [6, 7], "rejected_ids": [8, 9, 10]},
            {"prompt_ids": [3], "chosen_ids": [4, 5, 6], "rejected_ids": [7]},
        ]
    )


@pytest.mark.parametrize("make", [groups_batch, pairs_batch, tree_batch])
@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (4, 2)])
def test_two_calls_merged_by_lse_equal_per_document_attention(monkeypatch, make, heads, kv_heads):
    monkeypatch.setattr(attention, "_varlen_ops", lambda: (reference_forward, reference_backward))
    batch = make()
    T, D = batch.num_tokens, 8
    torch.manual_seed(0)
    tensors = [torch.randn(1, h, T, D, dtype=torch.float64) for h in (heads, kv_heads, kv_heads)]
    weight = torch.randn(1, T, heads, D, dtype=torch.float64)
    scale = D**-0.5
    results = []
    for run in ("ours", "reference"):
        q, k, v = (t.clone().requires_grad_(True) for t in tensors)
        if run == "ours":
            out = prefixed_varlen_attention(q, k, v, batch, scale)
        else:
            fn = functools.partial(_sdpa_one, short_kernel="off")
            out = _per_document(fn, batch, q, k, v, scaling=scale, dropout=0.0, window=None)
        (out * weight).sum().backward()
        results.append((out.detach(), q.grad, k.grad, v.grad))
    for ours, theirs, name in zip(*results, ("out", "dq", "dk", "dv"), strict=False):
        torch.testing.assert_close(ours, theirs, rtol=1e-10, atol=1e-10, msg=name)


def test_a_dropped_merge_would_be_seen(monkeypatch):
    """Negative control: the second call's share left out gives a different output."""
    monkeypatch.setattr(attention, "_varlen_ops", lambda: (reference_forward, reference_backward))
    batch = groups_batch()
    q = torch.randn(1, 2, batch.num_tokens, 8, dtype=torch.float64)
    ours = prefixed_varlen_attention(q, q, q, batch, 0.3)
    plain = _per_document(
        functools.partial(_sdpa_one, short_kernel="off"),
        dataclasses_replace(batch),
        q, q, q, scaling=0.3, dropout=0.0, window=None,
    )  # fmt: skip
    assert (ours - plain).abs().max().item() > 1e-3


def dataclasses_replace(batch):
    import dataclasses

    return dataclasses.replace(batch, prefix_lens=None, prefix_sources=None, _memo={})
