"""The packed training step on a fake CUDA device: the backend chosen, and no host read anywhere.

Every step here runs forward and backward on fake CUDA tensors, where any data-dependent host
read raises (``HOST_READ_ERRORS``); the negative controls inject one and watch it raise.
"""

import functools

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import slipstream
from slipstream.models import build_model
from slipstream.packing.attention import choose_backend, varlen
from tests.conftest import random_docs
from tests.fake_cuda import (
    HOST_READ_ERRORS,
    backward_by_hand,
    fake_cuda,
    requires_fake_cuda,
    skip_logit_probe,
    tiny_cuda_model,
    train_step,
)

pytestmark = pytest.mark.filterwarnings("ignore:Accessing the data pointer of FakeTensor:UserWarning")

DOCS = random_docs([30, 50, 20])
ROW_POSITION_DOCS = random_docs([11, 30, 20], vocab_size=200)  # ids inside the tiny registry vocabulary
CUDA = torch.device("cuda")
KERNEL = ("torch.varlen_attn", lambda *args, **kwargs: None)


@pytest.mark.parametrize(
    "kernel, sinks, backend, reason",
    [
        (KERNEL, False, "varlen", "CUDA with torch.varlen_attn"),
        (("flash_attn", KERNEL[1]), False, "varlen", "CUDA with flash_attn"),
        (KERNEL, True, "sdpa", "attention sinks"),
        (None, False, "sdpa", "CUDA without a varlen kernel"),
    ],
)
def test_auto_backend_on_cuda(monkeypatch, kernel, sinks, backend, reason):
    monkeypatch.setattr(varlen, "varlen_kernel", lambda: kernel)
    chosen, why = choose_backend("auto", CUDA, has_sinks=sinks)
    assert chosen == backend and reason in why


def test_requested_backends_on_cuda(monkeypatch):
    monkeypatch.setattr(varlen, "varlen_kernel", lambda: None)
    with pytest.raises(ValueError, match="needs CUDA"):
        choose_backend("varlen", CUDA, has_sinks=False)
    assert choose_backend("flex", CUDA, has_sinks=False) == ("flex", "requested")
    monkeypatch.setattr(varlen, "varlen_kernel", lambda: KERNEL)
    assert choose_backend("varlen", CUDA, has_sinks=False) == ("varlen", "requested")
    assert choose_backend("auto", torch.device("cpu"), has_sinks=False)[0] == "sdpa"


def test_varlen_kernel_is_torchs_own_where_cuda_is_available(monkeypatch):
    from torch.nn.attention.varlen import varlen_attn

    assert varlen.varlen_kernel() is None  # this CPU build
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert varlen.varlen_kernel() == ("torch.varlen_attn", varlen_attn)


def varlen_windows(monkeypatch) -> list:
    """Record the window each call of the (real) varlen kernel gets."""
    windows, real = [], varlen.varlen_kernel

    def kernel():
        name, fn = real()

        @functools.wraps(fn)
        def recorded(*args, **kwargs):
            windows.append(kwargs.get("window_size"))
            return fn(*args, **kwargs)

        return name, recorded

    monkeypatch.setattr(varlen, "varlen_kernel", kernel)
    return windows


@requires_fake_cuda
@pytest.mark.parametrize(
    "family, backend, windows",
    [
        ("llama", "slipstream_varlen", [(-1, 0)] * 2),
        ("qwen3-sliding", "slipstream_varlen", [(7, 0), (-1, 0)]),  # window 8: 7 keys to the left
        ("qwen3-moe", "slipstream_varlen", [(-1, 0)] * 2),
        ("gpt-oss", "slipstream_docwise", []),  # sinks: the per-document path
    ],
)
def test_packed_bf16_step_on_cuda_has_no_host_read(monkeypatch, family, backend, windows):
    seen = varlen_windows(monkeypatch)
    with fake_cuda(cuda_available=True):
        model = tiny_cuda_model(family)
        slipstream.optimize(model)
        skip_logit_probe(model)
        batch = slipstream.collate_packed(DOCS, device="cuda")
        loss, grads = train_step(model, batch)  # a host read anywhere would raise
    state = slipstream.state_of(model)
    assert state.packed_attention == backend
    assert seen == windows
    assert loss.device.type == "cuda" and loss.dtype == torch.float32
    assert all(p in grads and grads[p].dtype == p.dtype for p in model.parameters() if p.requires_grad)


@requires_fake_cuda
@pytest.mark.parametrize("model_type", ["llama4_text", "phi3"])
def test_row_position_adaptations_on_cuda_have_no_host_read(monkeypatch, model_type):
    """Llama 4's temperature by document position and longrope's per-document factors (documents of
    11, 30 and 20 tokens on both sides of the tiny thresholds of 16) on the varlen path."""
    from slipstream.models.tiny_any import causal_lm_class, config_for_class, tiny_config

    seen = varlen_windows(monkeypatch)
    cls = causal_lm_class(model_type)
    config = config_for_class(cls, tiny_config(model_type))
    with fake_cuda(cuda_available=True):
        with torch.device("cuda"):
            model = cls._from_config(config, attn_implementation="eager", dtype=torch.bfloat16).train()
        slipstream.optimize(model)
        skip_logit_probe(model)
        loss, grads = train_step(model, slipstream.collate_packed(ROW_POSITION_DOCS, device="cuda"))
    assert slipstream.state_of(model).packed_attention == "slipstream_varlen" and seen
    assert any(
        "adapted: " in p and ("temperature" in p or "longrope" in p)
        for p in slipstream.state_of(model).policies
    )
    assert len(grads) == sum(p.requires_grad for p in model.parameters())


@requires_fake_cuda
def test_cuda_without_a_varlen_kernel_runs_per_document_sdpa():
    with fake_cuda(cuda_available=False):
        model = tiny_cuda_model("llama")
        slipstream.optimize(model)
        skip_logit_probe(model)
        loss, grads = train_step(model, slipstream.collate_packed(DOCS, device="cuda"))
    assert slipstream.state_of(model).packed_attention == "slipstream_docwise"
    assert len(grads) == sum(p.requires_grad for p in model.parameters())


@requires_fake_cuda
@pytest.mark.parametrize(
    "read, error",
    [
        (lambda t: t.sum().item(), "DataDependentOutputException"),
        (lambda t: t[0, 0].tolist(), "DataDependentOutputException"),
        (lambda t: bool(t.isfinite().all()), "DataDependentOutputException"),
        (lambda t: torch.nonzero(t), "DynamicOutputShapeException"),
    ],
)
def test_the_step_harness_catches_a_host_read(read, error):
    """Negative control: the same step with one host read in a layer's forward hook raises."""
    with fake_cuda(cuda_available=True):
        model = tiny_cuda_model("qwen3-moe")
        slipstream.optimize(model)
        skip_logit_probe(model)
        model.model.layers[1].mlp.register_forward_hook(lambda module, args, out: read(out))
        with pytest.raises(HOST_READ_ERRORS) as raised:
            train_step(model, slipstream.collate_packed(DOCS, device="cuda"))
    assert type(raised.value).__name__ == error


@requires_fake_cuda
def test_a_fresh_models_first_host_read_is_the_logit_probe():
    """The chunked loss's documented once-per-model read (the probe row) is caught too, and it is
    the first read of a fresh model's first step."""
    with fake_cuda(cuda_available=True):
        model = tiny_cuda_model("llama")
        slipstream.optimize(model)
        with pytest.raises(HOST_READ_ERRORS) as raised:
            train_step(model, slipstream.collate_packed(DOCS, device="cuda"))
    assert "_match_transform" in [frame.name for frame in raised.traceback]


class _Copies(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.to_cuda = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._to_copy.default and kwargs.get("device", args[0].device).type == "cuda":
            self.to_cuda.append((args[0], kwargs.get("non_blocking", False)))
        return func(*args, **kwargs)


@requires_fake_cuda
def test_collating_for_cuda_pins_then_copies_without_blocking():
    with fake_cuda(cuda_available=True) as cuda, _Copies() as copies:
        batch = slipstream.collate_packed(DOCS, device="cuda")
        chunked = batch.split_every(16)  # Llama 4's chunked attention: new cu_seqlens, moved once
    assert len(copies.to_cuda) == 6  # ids, labels, positions, cu_seqlens, loss positions; the split's
    for source, non_blocking in copies.to_cuda:
        assert non_blocking and any(source is pinned for pinned in cuda.pinned)
    assert chunked.cu_seqlens.device.type == "cuda" and chunked.seq_lens[:3] == (16, 14, 16)


@pytest.mark.parametrize("family", ["llama", "qwen3-moe"])
def test_backward_by_hand_matches_the_engine(family):
    """The harness's backward (the engine cannot run on fake CUDA here) gives the engine's
    gradients on real CPU tensors: built-in nodes, slipstream's autograd Functions, the chunked loss."""
    model = build_model(family).train()
    slipstream.optimize(model)
    batch = slipstream.collate_packed(DOCS)
    loss = model(**batch.model_inputs()).loss
    by_hand = backward_by_hand([loss])
    loss.backward()
    for name, param in model.named_parameters():
        torch.testing.assert_close(by_hand[param], param.grad, rtol=1e-5, atol=1e-7, msg=name)


@requires_fake_cuda
@pytest.mark.parametrize("family", ["llama", "qwen3-sliding", "gpt-oss"])
def test_prefix_shared_pairs_on_cuda_have_no_host_read(monkeypatch, family):
    """A preference step's forward and backward on fake CUDA with the prompt shared: the varlen
    backend runs shared prompts as two varlen calls merged by log-sum-exp (per-document SDPA where
    the window cuts a sequence, or with sinks), the answers' log-probs come from the chunked head,
    the DPO loss is built on the device, and nothing is read to the host."""
    from slipstream.loss import answer_logprobs_of
    from slipstream.loss.preference import dpo_terms
    from slipstream.packing.pairs import collate_pairs

    seen = varlen_windows(monkeypatch)
    merged = prefixed_varlen_calls(monkeypatch)
    pairs = [
        {"prompt_ids": d[:20], "chosen_ids": d[20:27], "rejected_ids": d[27:]}
        for d in (doc["input_ids"] for doc in DOCS[:2])
    ]
    with fake_cuda(cuda_available=True):
        model = tiny_cuda_model(family)
        slipstream.optimize(model)
        skip_logit_probe(model)
        batch = collate_pairs(pairs, prefix_sharing=True, device="cuda")
        model(**batch.model_inputs())
        policy = answer_logprobs_of(batch)
        lengths = torch.tensor(batch.answers.lengths, dtype=torch.float32).to("cuda")
        terms = dpo_terms(policy, policy.detach() * 0.5, lengths, beta=0.1)
        grads = backward_by_hand([terms.losses.sum()])
    assert seen == []  # every attention call had a shared prompt: never the one-call varlen path
    assert len(merged) == {"llama": 2, "qwen3-sliding": 1, "gpt-oss": 0}[family]  # layers merged by lse
    assert policy.device.type == "cuda" and policy.shape == (4,)
    assert all(p in grads for p in model.parameters() if p.requires_grad)


def prefixed_varlen_calls(monkeypatch) -> list[int]:
    """Record the two-call varlen path for shared prefixes: the batch's document count per layer call."""
    calls: list[int] = []
    real = varlen.prefixed_varlen_attention

    def recorded(query, key, value, batch, scaling):
        calls.append(batch.num_docs)
        return real(query, key, value, batch, scaling)

    monkeypatch.setattr(varlen, "prefixed_varlen_attention", recorded)
    return calls


@requires_fake_cuda
@pytest.mark.parametrize("family", ["llama", "qwen3-sliding", "qwen3-moe"])
def test_prefix_groups_sft_step_on_cuda_has_no_host_read(monkeypatch, family):
    """An SFT step on prefix groups (N = 4 and a plain document) on fake CUDA: the varlen backend's
    two calls merged by log-sum-exp (per-document SDPA where the window of 8 cuts a sequence), the
    chunked loss read at loss_positions / loss_targets, the backward by hand: no host read."""
    from slipstream.packing.groups import collate_groups

    merged = prefixed_varlen_calls(monkeypatch)
    ids = DOCS[1]["input_ids"]
    groups = [
        {
            "prefix_ids": ids[:12],
            "prefix_labels": [-100] * 6 + ids[6:12],
            "continuations": [{"input_ids": ids[12 + 9 * j : 21 + 9 * j]} for j in range(4)],
        },
        {"prefix_ids": [], "continuations": [{"input_ids": DOCS[2]["input_ids"]}]},
    ]
    with fake_cuda(cuda_available=True):
        model = tiny_cuda_model(family)
        slipstream.optimize(model)
        skip_logit_probe(model)
        batch = collate_groups(groups, device="cuda")
        assert batch.loss_targets.device.type == "cuda"
        loss, grads = train_step(model, batch)  # a host read anywhere would raise
    assert slipstream.state_of(model).packed_attention == "slipstream_varlen"
    layers = model.config.num_hidden_layers
    windows = getattr(model.config, "layer_types", None) or []
    expected = layers - sum(kind == "sliding_attention" for kind in windows)
    assert merged == [5] * expected
    assert loss.device.type == "cuda" and loss.dtype == torch.float32
    assert all(p in grads and grads[p].dtype == p.dtype for p in model.parameters() if p.requires_grad)


@requires_fake_cuda
@pytest.mark.parametrize("family", ["llama", "qwen3-sliding"])
def test_prefix_tree_sft_step_on_cuda_has_no_host_read(monkeypatch, family):
    """An SFT step on a prefix tree of depth 3 (a node with three children, one with two of its own)
    on fake CUDA: the varlen backend's two calls over every node's ancestors, the chunked loss read at
    the rows' loss_positions / loss_targets, the backward by hand: no host read."""
    from slipstream.data.prefix_tree import tree_items
    from slipstream.packing.trees import collate_trees

    merged = prefixed_varlen_calls(monkeypatch)
    ids = DOCS[1]["input_ids"]
    root, a, b = ids[:10], ids[10:16], ids[16:20]
    rows = [root + a + ids[20:24], root + a + ids[24:30], root + b, root + ids[30:35], DOCS[2]["input_ids"]]
    trees, _ = tree_items([{"input_ids": r, "labels": [-100] * 5 + r[5:]} for r in rows], 512, min_shared=1)
    with fake_cuda(cuda_available=True):
        model = tiny_cuda_model(family)
        slipstream.optimize(model)
        skip_logit_probe(model)
        batch = collate_trees(trees, device="cuda")
        assert batch.parents == (-1, 0, 1, 1, 0, 0, -1)
        loss, grads = train_step(model, batch)  # a host read anywhere would raise
    layers = model.config.num_hidden_layers
    windows = getattr(model.config, "layer_types", None) or []
    assert merged == [7] * (layers - sum(kind == "sliding_attention" for kind in windows))
    assert loss.device.type == "cuda" and loss.dtype == torch.float32
    assert all(p in grads and grads[p].dtype == p.dtype for p in model.parameters() if p.requires_grad)
