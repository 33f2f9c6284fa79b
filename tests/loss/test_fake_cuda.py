"""The chunked loss's CUDA branches: the chunk size from free memory, and rows chosen with no sync."""

import pytest
import torch

import slipstream
from slipstream.loss import choose_chunk_tokens, chunked_loss
from slipstream.models import build_model
from tests.conftest import random_docs
from tests.fake_cuda import (
    HOST_READ_ERRORS,
    GiB,
    backward_by_hand,
    fake_cuda,
    requires_fake_cuda,
    skip_logit_probe,
    tiny_cuda_model,
    train_step,
)

pytestmark = pytest.mark.filterwarnings("ignore:Accessing the data pointer of FakeTensor:UserWarning")

CUDA = torch.device("cuda")
DOCS = random_docs([30, 50, 20])


def patch_memory(monkeypatch, free, reserved=0, allocated=0):
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, 80 * GiB))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: reserved)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: allocated)


def test_cuda_chunk_is_a_quarter_of_free_memory_counting_the_allocators_cache(monkeypatch):
    # free to the driver 8 GiB, plus 3 GiB the caching allocator holds of which 1 GiB is in use
    patch_memory(monkeypatch, free=8 * GiB, reserved=3 * GiB, allocated=1 * GiB)
    tokens, reason = choose_chunk_tokens(151936, torch.bfloat16, CUDA)
    row = 151936 * (2 + 4 + 2)  # bf16 logits, their fp32 copy, the bf16 gradient
    assert tokens == (10 * GiB // 4 // row) // 64 * 64 == 2176
    assert "25% of 10.0 GiB free" in reason and "bfloat16" in reason


@pytest.mark.parametrize("free, tokens", [(0, 64), (1 << 40, 16384)])
def test_cuda_chunk_stays_within_its_bounds(monkeypatch, free, tokens):
    patch_memory(monkeypatch, free=free)
    assert choose_chunk_tokens(151936, torch.bfloat16, CUDA)[0] == tokens


def test_a_set_chunk_ignores_cuda_memory(monkeypatch):
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: pytest.fail("read free memory"))
    assert choose_chunk_tokens(151936, torch.bfloat16, CUDA, override=300)[0] == 300


def unpacked_batch(lengths=(100,)):
    """One row per document, its first 20 labels masked: no PackedBatch rides along."""
    ids = torch.tensor(random_docs(list(lengths))[0]["input_ids"]).view(1, -1)
    labels = ids.clone()
    labels[:, :20] = -100
    return ids, labels


def rows_reaching_the_head(monkeypatch) -> list[int]:
    rows, real = [], chunked_loss.linear_cross_entropy

    def counted(hidden_NH, *args, **kwargs):
        rows.append(hidden_NH.shape[0])
        return real(hidden_NH, *args, **kwargs)

    monkeypatch.setattr(chunked_loss, "linear_cross_entropy", counted)
    return rows


@requires_fake_cuda
def test_on_cuda_without_a_packed_batch_every_row_is_projected_without_a_sync(monkeypatch):
    rows = rows_reaching_the_head(monkeypatch)
    ids, labels = unpacked_batch()
    with fake_cuda() as cuda:
        model = tiny_cuda_model("qwen3")
        slipstream.optimize(model, loss_chunk_tokens=32)  # 4 chunks of the 100 rows
        skip_logit_probe(model)
        loss = model(input_ids=cuda.to_cuda(ids), labels=cuda.to_cuda(labels)).loss
        grads = backward_by_hand([loss])  # no nonzero, no item: it would raise
    assert rows == [100]  # the masked rows too (they weigh zero) rather than a sync to drop them
    assert slipstream.state_of(model).chunked_loss.chunk_tokens == 32
    assert len(grads) == sum(p.requires_grad for p in model.parameters())


def test_on_cpu_the_same_batch_projects_only_labelled_rows(monkeypatch):
    """The contrast: on a CPU the rows are found with nonzero (no device to stall)."""
    rows = rows_reaching_the_head(monkeypatch)
    ids, labels = unpacked_batch()
    model = build_model("qwen3").train()
    slipstream.optimize(model)
    model(input_ids=ids, labels=labels).loss.backward()
    assert rows == [80]  # positions 19..98 predict the 80 unmasked labels 20..99


@requires_fake_cuda
def test_on_cuda_a_packed_batch_projects_its_host_known_positions(monkeypatch):
    rows = rows_reaching_the_head(monkeypatch)
    with fake_cuda(free_bytes=64 << 20):
        model = tiny_cuda_model("qwen3")
        slipstream.optimize(model)
        skip_logit_probe(model)
        batch = slipstream.collate_packed(DOCS, device="cuda")
        train_step(model, batch)
    assert rows == [batch.num_label_tokens] == [97]
    # the chunk from fake free memory: a quarter of 64 MiB over 512 x 8 bytes a row
    assert slipstream.state_of(model).chunked_loss.chunk_tokens == (16 << 20) // (512 * 8) == 4096


@requires_fake_cuda
def test_selecting_rows_with_nonzero_on_cuda_is_caught(monkeypatch):
    """Negative control: the CPU branch's nonzero on a CUDA tensor is a sync, and the fake step raises."""
    monkeypatch.setattr(
        chunked_loss.ChunkedLoss,
        "_labelled_positions",
        staticmethod(
            lambda call, labels, shift_labels, targets, ignore: torch.nonzero(targets != ignore)[:, 0]
        ),
    )
    ids, labels = unpacked_batch()
    with fake_cuda() as cuda:
        model = tiny_cuda_model("qwen3")
        slipstream.optimize(model)
        skip_logit_probe(model)
        with pytest.raises(HOST_READ_ERRORS, match="nonzero"):
            model(input_ids=cuda.to_cuda(ids), labels=cuda.to_cuda(labels))
