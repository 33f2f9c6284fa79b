"""The per-architecture verdict: each adaptation makes a family exact (and its absence makes it
wrong), each refusal names the feature and the option to use instead."""

from __future__ import annotations

import sys

import pytest
import torch

import slipstream
from slipstream.bench.compat import documents, reference, run_arm
from slipstream.models.tiny_any import tiny_config, tiny_model
from slipstream.offload import RecordingEngine, UnsupportedCheckpointing, enable_checkpointing
from slipstream.packing import collate_packed
from slipstream.packing.guards import UnsupportedArchitecture
from slipstream.packing.verdict import architecture_verdict, find_token_mixers

# model type -> the token mixer class the verdict must find in it
MIXER_FAMILIES = {
    "lfm3": "Lfm3ShortConv",  # a causal short convolution
    "granitemoehybrid": "GraniteMoeHybridMambaLayer",  # Mamba-2 conv + scan
    "minimax": "MiniMaxLightningAttention",  # linear (lightning) attention with a running state
}


def _without_adaptations(monkeypatch):
    module = sys.modules["slipstream.optimize"]
    monkeypatch.setattr(module, "apply_adaptations", lambda model, verdict: lambda: None)


@pytest.mark.parametrize("model_type", sorted(MIXER_FAMILIES))
def test_token_mixers_run_per_document_and_are_exact(model_type, monkeypatch):
    stock = tiny_model(model_type)
    assert MIXER_FAMILIES[model_type] in {type(m).__name__ for _, m in find_token_mixers(stock)}
    docs = documents(stock)
    ref = reference(stock, docs)
    adapted = run_arm(stock, docs, ref, {})
    assert adapted.status == "pass", adapted.detail
    assert any("run once per document" in p for p in adapted.policies)
    _without_adaptations(monkeypatch)
    leaking = run_arm(stock, docs, ref, {})
    assert leaking.status == "WRONG"  # the state of one document reaches the next


def test_the_per_document_mixers_recompute_with_the_batch_of_their_forward():
    """Checkpointed layers recompute in backward, after the model's forward has returned."""
    stock = tiny_model("lfm3")
    docs = documents(stock)
    ref = reference(stock, docs)
    for mode in ("recompute", "offload-double"):
        model = tiny_model("lfm3")
        model.load_state_dict(stock.state_dict())
        slipstream.optimize(model)
        engine = RecordingEngine() if mode.startswith("offload") else None
        enable_checkpointing(model, mode, engine=engine, min_offload_bytes=0)
        model.train()
        out = model(**collate_packed([{"input_ids": d} for d in docs]).model_inputs())
        out.loss.backward()
        assert abs(out.loss.item() - ref.loss) <= 1e-5 * abs(ref.loss)
        for name, param in model.named_parameters():
            if ref.grads.get(name) is not None:
                torch.testing.assert_close(param.grad, ref.grads[name], rtol=1e-4, atol=1e-6, msg=name)


def _roberta_decoder():
    config = tiny_config("roberta")
    config.is_decoder = True  # RobertaForCausalLM is a causal LM only as a decoder
    from transformers import RobertaForCausalLM

    torch.manual_seed(0)
    return RobertaForCausalLM._from_config(config, attn_implementation="eager", dtype=torch.float32)


def test_roberta_positions_are_shifted_by_padding_idx_plus_one(monkeypatch):
    stock = _roberta_decoder()
    verdict = architecture_verdict(stock)
    assert verdict.position_offset == stock.config.pad_token_id + 1
    docs = documents(stock)
    ref = reference(stock, docs)
    assert run_arm(stock, docs, ref, {}).status == "pass"
    _without_adaptations(monkeypatch)
    assert run_arm(stock, docs, ref, {}).status == "WRONG"


@pytest.mark.parametrize(
    "model_type, feature",
    [
        ("mamba", "does not route attention through transformers' AttentionInterface"),
        ("deepseek_v32", "sparse-attention indexer"),
        ("gemma2", "attention logit softcapping"),
    ],
)
def test_refusals_name_the_feature_and_the_way_out(model_type, feature):
    model = tiny_model(model_type)
    with pytest.raises(UnsupportedArchitecture, match=feature) as error:
        slipstream.optimize(model)
    assert "slipstream.optimize(model, packed_attention=False)" in str(error.value)


def test_a_layer_run_twice_per_forward_refuses_offload():
    """Dory runs its decoder layers in a loop; one saved input per layer cannot serve both calls."""
    model = tiny_model("dory")
    slipstream.optimize(model)
    enable_checkpointing(model, "offload-double", engine=RecordingEngine(), min_offload_bytes=0)
    model.train()
    docs = documents(model)
    out = model(**collate_packed([{"input_ids": d} for d in docs]).model_inputs())
    with pytest.raises(UnsupportedCheckpointing, match="ran more than once.*checkpointing='recompute'"):
        out.loss.backward()
