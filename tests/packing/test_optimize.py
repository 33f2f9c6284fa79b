"""optimize(): the toggles, the refusals, and the unpacked paths of the packed attention."""

import logging

import pytest
import torch
from transformers import AutoModelForCausalLM, Gemma2Config

import slipstream
from slipstream.models import build_model
from slipstream.packing import collate_padded
from tests.conftest import random_docs


def test_optimize_returns_the_same_model_and_logs_its_policy(caplog):
    model = build_model("llama")
    with caplog.at_level(logging.INFO, logger="slipstream"):
        assert slipstream.optimize(model) is model
    assert "packed attention: slipstream_docwise" in caplog.text
    assert model.slipstream.packed_attention == "slipstream_docwise"


def test_packed_attention_false_leaves_a_fresh_model_stock():
    model = build_model("llama")
    slipstream.optimize(model, packed_attention=False)
    assert model.config._attn_implementation == "sdpa"


def test_softcapping_is_refused_not_approximated():
    config = Gemma2Config(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        attn_logit_softcapping=50.0,
    )
    model = AutoModelForCausalLM.from_config(config)
    with pytest.raises(NotImplementedError, match="softcapping"):
        slipstream.optimize(model)


def test_unknown_backend_is_an_error():
    with pytest.raises(ValueError, match="attention_backend"):
        slipstream.optimize(build_model("llama"), attention_backend="magic")


def test_a_padding_mask_without_a_packed_batch_is_refused():
    model = slipstream.optimize(build_model("qwen3"))
    with pytest.raises(ValueError, match="PackedBatch"):
        model(**collate_padded(random_docs([3, 6])))


@pytest.mark.parametrize("family", ["qwen3", "gpt-oss"])
def test_unpacked_rows_and_cached_generation_match_stock(family):
    stock = build_model(family, attn_implementation="eager")
    packed = build_model(family, attn_implementation="eager")
    packed.load_state_dict(stock.state_dict())
    slipstream.optimize(packed)
    ids = torch.tensor([d["input_ids"] for d in random_docs([20, 20])])
    with torch.no_grad():
        torch.testing.assert_close(packed(input_ids=ids).logits, stock(input_ids=ids, use_cache=False).logits)
        kwargs = dict(max_new_tokens=12, do_sample=False, use_cache=True, pad_token_id=0)
        assert torch.equal(packed.generate(ids[:1], **kwargs), stock.generate(ids[:1], **kwargs))


def test_gradient_accumulation_weights_tokens_not_micro_batches():
    """Two micro-batches of very different sizes, weighted by num_items_in_batch, give the
    gradient of one batch holding all their documents."""
    model = slipstream.optimize(build_model("llama"))
    docs = random_docs([40, 33, 3, 4], seed=3)
    micro = [slipstream.collate_packed(docs[:2]), slipstream.collate_packed(docs[2:])]
    total = sum(b.num_label_tokens for b in micro)
    model.zero_grad()
    for batch in micro:
        model(**batch.model_inputs(num_items_in_batch=total)).loss.backward()
    accumulated = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    whole = slipstream.collate_packed(docs)
    assert whole.num_label_tokens == total
    model(**whole.model_inputs()).loss.backward()
    for acc, ref in zip(accumulated, (p.grad for p in model.parameters()), strict=True):
        torch.testing.assert_close(acc, ref, rtol=1e-5, atol=1e-7)
    # and a plain mean over micro-batches would not: the small one would weigh as much as the big one
    model.zero_grad()
    for batch in micro:
        (model(**batch.model_inputs()).loss / 2).backward()
    naive = [p.grad for p in model.parameters()]
    assert any(not torch.allclose(a, b, rtol=1e-3) for a, b in zip(naive, accumulated, strict=True))


def test_flex_backend_matches_and_builds_its_block_mask_once_per_batch(monkeypatch):
    """flex has no backward on CPU, so this checks the forward and the memo."""
    import torch.nn.attention.flex_attention as flex

    calls = []
    real = flex.create_block_mask
    monkeypatch.setattr(flex, "create_block_mask", lambda *a, **k: calls.append(1) or real(*a, **k))
    reference = slipstream.optimize(build_model("qwen3-sliding"), attention_backend="sdpa")
    model = build_model("qwen3-sliding")
    model.load_state_dict(reference.state_dict())
    slipstream.optimize(model, attention_backend="flex")
    batch = slipstream.collate_packed(random_docs([5, 17, 9, 30, 12]))
    with torch.no_grad():
        torch.testing.assert_close(
            model(**batch.model_inputs()).logits, reference(**batch.model_inputs()).logits
        )
    # two layers, one sliding and one full: one mask each, memoised on the batch
    assert len(calls) == 2
    with torch.no_grad():
        model(**batch.model_inputs())
    assert len(calls) == 2


def test_custom_attention_scaling_is_honoured():
    """Granite scales attention by config.attention_multiplier instead of 1/sqrt(head_dim)."""
    from transformers import GraniteConfig

    config = GraniteConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        attention_multiplier=0.5,
        use_cache=False,
    )
    stock = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    packed = AutoModelForCausalLM.from_config(config)
    packed.load_state_dict(stock.state_dict())
    slipstream.optimize(packed)
    docs = random_docs([7, 19, 4, 11])
    batch = slipstream.collate_packed(docs)
    with torch.no_grad():
        logits = packed(**batch.model_inputs()).logits
        for (start, end), doc in zip(batch.doc_bounds(), docs, strict=True):
            alone = stock(input_ids=torch.tensor([doc["input_ids"]])).logits
            assert (logits[0, start:end] - alone[0]).abs().max().item() <= 1e-5
