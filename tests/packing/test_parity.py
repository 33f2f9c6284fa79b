"""Packed attention computes what stock transformers computes, document by document."""

import pytest
import torch

import slipstream
from slipstream.models import build_model
from slipstream.packing import collate_padded
from tests.conftest import random_docs

FAMILIES = ["llama", "qwen3", "qwen3-sliding", "qwen3-moe", "gpt-oss"]
# Different lengths; several longer than the tiny sliding window (8) so windows matter.
LENGTHS = [5, 17, 9, 30, 12]


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual - expected).norm() / expected.norm().clamp_min(1e-12)).item()


@pytest.fixture(scope="module", params=FAMILIES)
def models(request):
    stock = build_model(request.param, attn_implementation="eager")
    packed = build_model(request.param, attn_implementation="eager")
    packed.load_state_dict(stock.state_dict())
    slipstream.optimize(packed, packed_attention=True)
    return request.param, stock, packed


def test_packed_logits_match_each_document_alone(models):
    _, stock, packed = models
    docs = random_docs(LENGTHS)
    batch = slipstream.collate_packed(docs)
    with torch.no_grad():
        logits = packed(**batch.model_inputs()).logits
        for (start, end), doc in zip(batch.doc_bounds(), docs, strict=True):
            alone = stock(input_ids=torch.tensor([doc["input_ids"]]), use_cache=False).logits
            assert (logits[0, start:end] - alone[0]).abs().max().item() <= 1e-5


def test_packed_loss_and_gradients_match_the_padded_batch(models):
    name, stock, packed = models
    docs = random_docs(LENGTHS, seed=2)
    stock.zero_grad()
    packed.zero_grad()
    packed_out = packed(**slipstream.collate_packed(docs).model_inputs())
    stock_out = stock(**collate_padded(docs))
    packed_out.loss.backward()
    stock_out.loss.backward()
    assert relative_error(packed_out.loss, stock_out.loss) <= 1e-5
    checked = 0
    for (param_name, p_packed), (_, p_stock) in zip(
        packed.named_parameters(), stock.named_parameters(), strict=True
    ):
        if p_stock.grad is None:
            assert p_packed.grad is None, param_name
            continue
        assert relative_error(p_packed.grad, p_stock.grad) <= 1e-5, f"{name}: {param_name}"
        checked += 1
    assert checked > 10


def test_stock_attention_comes_back_when_the_toggle_is_off():
    model = build_model("qwen3")
    slipstream.optimize(model)
    assert model.config._attn_implementation == "slipstream_docwise"
    assert model.config.use_cache is False
    slipstream.optimize(model, packed_attention=False)
    assert model.config._attn_implementation == "sdpa"
    docs = random_docs([4, 6])
    padded = collate_padded(docs)
    model(**padded)  # the padding guard is gone with the packed attention
