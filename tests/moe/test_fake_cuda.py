"""The CUDA grouped_mm path on a fake CUDA device: the support rule, and every operand it feeds.

``GroupedMMChecker`` sees each ``aten._grouped_mm`` of a bf16 MoE step, forward and backward,
and fails on an operand CUDA's kernel would refuse; the negative controls show it does.
"""

import pytest
import torch

import slipstream
from slipstream import host_reads
from slipstream.moe import grouped
from slipstream.moe.grouped import grouped_mm_supported
from slipstream.moe.lora import add_expert_lora
from tests.conftest import random_docs
from tests.fake_cuda import (
    HOST_READ_ERRORS,
    GroupedMMChecker,
    MisalignedGroupedMM,
    backward_by_hand,
    fake_cuda,
    requires_fake_cuda,
    skip_logit_probe,
    tiny_cuda_model,
)

pytestmark = [
    requires_fake_cuda,
    # slipstream's alignment rule reads data_ptr(); on a fake tensor that is the storage offset in
    # bytes (its storage starts at 0), which is the part of the address the rule is about.
    pytest.mark.filterwarnings("ignore:Accessing the data pointer of FakeTensor:UserWarning"),
]

DOCS = random_docs([30, 50, 20])


@pytest.mark.parametrize(
    "capability, dtype, supported, reason",
    [
        ((9, 0), torch.bfloat16, True, "grouped_mm"),
        ((8, 0), torch.bfloat16, True, "grouped_mm"),
        ((7, 5), torch.bfloat16, False, "compute capability 8.0+"),
        ((9, 0), torch.float16, False, "runs bfloat16, not torch.float16"),
        ((9, 0), torch.float32, False, "runs bfloat16, not torch.float32"),
    ],
)
def test_cuda_grouped_mm_needs_sm80_and_bf16(capability, dtype, supported, reason):
    with fake_cuda(capability=capability):
        x = torch.randn(10, 64, device="cuda", dtype=dtype)
        weight = torch.randn(8, 64, 32, device="cuda", dtype=dtype)
        ok, why = grouped_mm_supported(x, weight)
    assert ok is supported and reason in why


@pytest.mark.parametrize("rank", [4, 8, 16])
@pytest.mark.parametrize("transposed", [False, True])
def test_bf16_lora_factors_take_grouped_mm_only_with_16_byte_rows(rank, transposed):
    """Rank r in bf16 is a 2r-byte dimension: rank 4 (8 bytes) must not reach grouped_mm."""
    with fake_cuda():
        x = torch.randn(10, 64, device="cuda", dtype=torch.bfloat16)
        mid = torch.randn(10, rank, device="cuda", dtype=torch.bfloat16)
        # [E, r, in] / [E, out, r] (Qwen3-MoE) or [E, in, r] / [E, r, out] (GPT-OSS), as run
        a = torch.randn(8, 64, rank, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(8, rank, 64, device="cuda", dtype=torch.bfloat16)
        if not transposed:
            a = a.transpose(-2, -1).contiguous().transpose(-2, -1)
            b = b.transpose(-2, -1).contiguous().transpose(-2, -1)
        verdicts = [grouped_mm_supported(x, a), grouped_mm_supported(mid, b)]
    for ok, why in verdicts:
        assert ok is (rank >= 8), why
        if not ok:
            assert "16-byte" in why or "16 bytes" in why


def test_misaligned_views_are_refused_on_cuda():
    with fake_cuda():
        rows = torch.randn(11, 64, device="cuda", dtype=torch.bfloat16)
        weight = torch.randn(8, 64, 32, device="cuda", dtype=torch.bfloat16)
        odd_start = rows.view(-1)[4 : 4 + 640].view(10, 64)  # 8 bytes into the buffer
        odd_pitch = torch.randn(10, 68, device="cuda", dtype=torch.bfloat16)[:, :64]  # 136-byte rows
        assert grouped_mm_supported(rows, weight)[0]
        for x in (odd_start, odd_pitch):
            ok, why = grouped_mm_supported(x, weight)
            assert not ok and "16-byte" in why


def moe_step(family: str, rank: int | None, compute: str = "grouped_mm", checker=None):
    """A bf16 packed training step of ``family`` on fake CUDA under the checker:
    (forward grouped_mm calls, backward ones, gradients, trainable parameters)."""
    checker = checker or GroupedMMChecker()
    model = tiny_cuda_model(family)
    slipstream.optimize(model, moe_compute=compute)
    if rank is not None:
        add_expert_lora(model, r=rank, alpha=2 * rank)
    skip_logit_probe(model)
    batch = slipstream.collate_packed(DOCS, device="cuda")
    with checker:
        loss = model(**batch.model_inputs()).loss
        forward = list(checker.calls)
        grads = backward_by_hand([loss])
    trainable = [p for p in model.parameters() if p.requires_grad]
    return forward, checker.calls[len(forward) :], grads, trainable


@pytest.mark.parametrize("family", ["qwen3-moe", "gpt-oss"])
@pytest.mark.parametrize("rank", [None, 8])
def test_bf16_moe_step_feeds_grouped_mm_only_aligned_bf16_operands(family, rank):
    with fake_cuda():
        forward, backward, grads, trainable = moe_step(family, rank)
    layers, projections = 2, 2
    per_projection = 1 if rank is None else 3  # the base weight, then LoRA's A and B
    assert len(forward) == layers * projections * per_projection
    # backward runs grouped_mm too (input gradients, and the weight gradients of trained factors)
    assert len(backward) >= len(forward)
    assert all(call.dtypes == (torch.bfloat16,) * 3 for call in forward + backward)
    assert all(p in grads for p in trainable)  # and no host read on the way (it would raise)


def test_checker_refuses_an_operand_torch_meta_accepts():
    """Negative control: 8 bytes into its buffer. torch's meta (the CUDA stride rules) takes it;
    the checker's start-address rule does not."""
    with fake_cuda():
        buffer = torch.randn(21 * 64, device="cuda", dtype=torch.bfloat16)
        x = buffer[4 : 4 + 20 * 64].view(20, 64)
        weight = torch.randn(2, 64, 32, device="cuda", dtype=torch.bfloat16)
        offs = torch.tensor([8, 20], dtype=torch.int32, device="cuda")
        torch._grouped_mm(x, weight, offs=offs)  # the meta kernel alone lets it through
        with GroupedMMChecker(), pytest.raises(MisalignedGroupedMM, match="starts 8 bytes"):
            torch._grouped_mm(x, weight, offs=offs)


def test_checker_catches_a_rank_4_lora_forced_onto_grouped_mm(monkeypatch):
    """Negative control: with the support rule bypassed, the rank-4 factor's 8-byte rows reach
    grouped_mm and the checker fails the step."""
    monkeypatch.setattr(grouped, "grouped_mm_supported", lambda x, weight: (True, "forced"))
    with fake_cuda(), pytest.raises(MisalignedGroupedMM, match=r"\(200, 4\) has strides"):
        moe_step("qwen3-moe", rank=4)


def test_checker_catches_fp16_forced_onto_grouped_mm(monkeypatch):
    monkeypatch.setattr(grouped, "grouped_mm_supported", lambda x, weight: (True, "forced"))
    with fake_cuda():
        x = torch.randn(20, 64, device="cuda", dtype=torch.float16)
        weight = torch.randn(2, 32, 64, device="cuda", dtype=torch.float16)
        with GroupedMMChecker(), pytest.raises(MisalignedGroupedMM, match="float16"):
            grouped.grouped_mm_linear(
                x, weight, torch.tensor([8, 20], dtype=torch.int32, device="cuda"), False
            )


def test_rank_4_bf16_lora_on_cuda_runs_its_factors_on_the_loop_path():
    """Unforced, the rank-4 factor leaves grouped_mm: the base projection ran on it, the factor
    goes to the loop path, whose one announced read of the counts is the host read that stops
    the fake step (the loop path's documented sync)."""
    announced, checker = [], GroupedMMChecker()
    unsubscribe = host_reads.subscribe(announced.append)
    try:
        with fake_cuda(), pytest.raises(HOST_READ_ERRORS):
            moe_step("qwen3-moe", rank=4, checker=checker)
    finally:
        unsubscribe()
    assert announced == ["tolist"]
    assert [call.shapes for call in checker.calls] == [((200, 64), (8, 64, 64), (200, 64))]  # the base only


def test_sm75_runs_the_whole_layer_on_the_loop_path():
    with fake_cuda(capability=(7, 5)), pytest.raises(RuntimeError, match="compute capability 8.0"):
        moe_step("qwen3-moe", rank=None, compute="grouped_mm")
    announced = []
    unsubscribe = host_reads.subscribe(announced.append)
    try:
        with fake_cuda(capability=(7, 5)), pytest.raises(HOST_READ_ERRORS):
            moe_step("qwen3-moe", rank=None, compute="auto")
    finally:
        unsubscribe()
    assert announced == ["tolist"]
