"""GPU-only: shared prefixes (prefix groups, preference pairs) on the varlen backend.

Two varlen calls merged by their log-sum-exps, with the backward written in slipstream (the kernel
drops a gradient of its lse): the output and the gradients against per-document SDPA in fp32, then a
whole SFT step of prefix groups against the per-document backend, under sync debug "error"."""

import copy
import functools

import pytest
import torch

import slipstream
from slipstream.models import build_model
from slipstream.packing.attention import _per_document, _sdpa_one, prefixed_varlen_attention
from slipstream.packing.groups import collate_groups

pytestmark = pytest.mark.gpu


def groups(vocab=512, seed=0):
    generator = torch.Generator().manual_seed(seed)

    def ids(n):
        return torch.randint(1, vocab, (n,), generator=generator).tolist()

    return [
        {
            "prefix_ids": ids(300),
            "prefix_labels": [-100] * 150 + ids(150),
            "continuations": [{"input_ids": ids(n)} for n in (64, 1, 200, 17, 128, 90, 33, 250)],
        },
        {"prefix_ids": [], "continuations": [{"input_ids": ids(129)}]},
        {"prefix_ids": ids(77), "continuations": [{"input_ids": ids(n)} for n in (40, 300, 5, 61)]},
    ]


@pytest.mark.parametrize("heads, kv_heads", [(8, 8), (8, 2)])
def test_prefixed_varlen_matches_per_document_attention_on_gpu(heads, kv_heads):
    batch = collate_groups(groups(), device="cuda")
    T, D = batch.num_tokens, 64
    torch.manual_seed(0)
    tensors = [torch.randn(1, h, T, D, device="cuda") for h in (heads, kv_heads, kv_heads)]
    weight = torch.randn(1, T, heads, D, device="cuda")
    results = []
    for run, dtype in (("varlen", torch.bfloat16), ("reference", torch.float32)):
        q, k, v = (t.to(dtype).requires_grad_(True) for t in tensors)
        if run == "varlen":
            out = prefixed_varlen_attention(q, k, v, batch, D**-0.5)
        else:
            fn = functools.partial(_sdpa_one, short_kernel="off")
            out = _per_document(fn, batch, q, k, v, scaling=D**-0.5, dropout=0.0, window=None)
        (out.float() * weight).sum().backward()
        results.append([t.float() for t in (out.detach(), q.grad, k.grad, v.grad)])
    for ours, theirs, name in zip(*results, ("out", "dq", "dk", "dv"), strict=False):
        error = ((ours - theirs).norm() / theirs.norm()).item()
        assert error < 2e-2, f"{name}: relative error {error}"


def test_prefix_groups_sft_step_on_varlen_matches_per_document_sdpa_without_a_sync():
    base = build_model("qwen3", dtype=torch.bfloat16).cuda()
    ref, fast = copy.deepcopy(base), base
    slipstream.optimize(ref, attention_backend="sdpa")
    slipstream.optimize(fast, attention_backend="varlen")
    batch = collate_groups(groups(vocab=base.config.vocab_size), device="cuda")
    losses, grads = [], []
    for model in (ref, fast):
        model.train().zero_grad(set_to_none=True)
        loss = model(**batch.model_inputs()).loss
        loss.backward()
        losses.append(loss.float())
        grads.append({n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None})
    assert abs(losses[0].item() - losses[1].item()) < 2e-2
    for name, grad in grads[1].items():
        error = ((grad - grads[0][name]).norm() / grads[0][name].norm().clamp_min(1e-12)).item()
        assert error < 5e-2, f"{name}: relative error {error}"
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fast(**batch.model_inputs()).loss.backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
