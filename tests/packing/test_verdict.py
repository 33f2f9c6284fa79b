"""The per-architecture verdict: each adaptation makes a family exact (and its absence makes it
wrong), each refusal names the feature and the option to use instead."""

from __future__ import annotations

import sys

import pytest
import torch

import slipstream
from slipstream.compat import documents, reference, run_arm
from slipstream.models.tiny_any import tiny_config, tiny_model
from slipstream.offload import RecordingEngine, UnsupportedCheckpointing, enable_checkpointing
from slipstream.packing import PACKED_BATCH_KWARG, collate_packed
from slipstream.packing.guards import UnsupportedArchitecture
from slipstream.packing.verdict import architecture_verdict, find_token_mixers

# model type -> the token mixer class the verdict must find in it
MIXER_FAMILIES = {
    "lfm3": "Lfm3ShortConv",  # a causal short convolution
    "granitemoehybrid": "GraniteMoeHybridMambaLayer",  # Mamba-2 conv + scan
    "minimax": "MiniMaxLightningAttention",  # linear (lightning) attention with a running state
}


def _without_adaptations(monkeypatch):
    module = sys.modules["slipstream.speedups.packed_attention"]  # where optimize() applies it
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


def test_chunked_attention_is_attended_per_document_chunk(monkeypatch):
    """Llama 4's chunked layers: pieces of attention_chunk_size counted from each document's start."""
    stock = tiny_model("llama4_text")
    chunk = stock.config.attention_chunk_size
    docs = documents(stock)
    assert "chunked_attention" in stock.config.layer_types and max(map(len, docs)) > chunk
    ref = reference(stock, docs)
    adapted = run_arm(stock, docs, ref, {})
    assert adapted.status == "pass", adapted.detail
    assert any("chunked-attention layers" in p for p in adapted.policies)
    monkeypatch.setattr("slipstream.packing.attention.call.chunked_attention_size", lambda module: None)
    assert run_arm(stock, docs, ref, {}).status == "WRONG"  # whole documents: wrong for chunked layers


def test_an_unpacked_row_is_chunked_too():
    """Without a PackedBatch (a plain row: an evaluation, a prompt) the chunked layers still attend
    within chunks counted from the row's start, as the model's own mask builder makes them."""
    stock = tiny_model("llama4_text")
    model = tiny_model("llama4_text")
    slipstream.optimize(model, chunked_loss=False)
    rows = torch.tensor(documents(stock, lengths=(3 * stock.config.attention_chunk_size + 5,) * 2))
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=rows).logits, stock(input_ids=rows).logits)


def test_split_every_cuts_each_document_from_its_start():
    batch = collate_packed([{"input_ids": list(range(3, 3 + n))} for n in (5, 8, 3)])
    split = batch.split_every(4)
    assert split.seq_lens == (4, 1, 4, 4, 3)
    assert split.cu_seqlens.tolist() == [0, 4, 5, 9, 13, 16] and split.max_seqlen == 4
    assert batch.split_every(4) is split  # built once per batch


def test_attention_computed_outside_the_interface_is_caught_on_the_first_packed_forward():
    """A hybrid transformers does not vouch for (``_supports_attention_backend`` False) trains
    packed only while every attention module that runs is seen calling slipstream's attention."""
    model = tiny_model("qwen3_next")
    assert not model._supports_attention_backend
    slipstream.optimize(model)
    assert any("first packed forward checks" in p for p in model.slipstream.policies)
    attention = next(m for _, m in model.named_modules() if type(m).__name__ == "Qwen3NextAttention")

    def inline_attention(hidden_states, *args, **kwargs):
        return hidden_states.clone(), None  # computed without the AttentionInterface

    attention.forward = inline_attention
    batch = collate_packed([{"input_ids": d} for d in documents(model)])
    with pytest.raises(UnsupportedArchitecture, match="Qwen3NextAttention computed attention without"):
        model(**batch.model_inputs())
    with pytest.raises(UnsupportedArchitecture, match="computed attention without"):
        model(**batch.model_inputs())  # and the next step too: refused is refused
    del attention.forward
    model(**batch.model_inputs())  # all routed: verified, and the check removes itself
    assert not slipstream.packing.guards.ATTENTION_CALL_LISTENERS


def test_a_model_transformers_does_not_vouch_for_without_token_mixers_stays_refused():
    model = tiny_model("llama")
    model._supports_attention_backend = False
    with pytest.raises(UnsupportedArchitecture, match="does not route attention through"):
        slipstream.optimize(model)


def test_hybrids_transformers_does_not_vouch_for_train_packed_when_their_attention_is_routed():
    stock = tiny_model("qwen3_next")  # Gated DeltaNet + gated attention, _supports_attention_backend False
    assert not stock._supports_attention_backend
    docs = documents(stock)
    result = run_arm(stock, docs, reference(stock, docs), {})
    assert result.status == "pass", result.detail


def test_a_mixer_off_the_packed_token_stream_runs_as_it_is():
    """An audio or vision tower's conv sees its own sequence, not the packed text row: not split."""
    from slipstream.packing.guards import enter_forward, leave_forward
    from slipstream.packing.verdict import _per_document_forward

    conv = torch.nn.Conv1d(4, 4, 3, padding=2, groups=4)

    def causal_conv(hidden_states):
        return conv(hidden_states.transpose(1, 2))[..., : hidden_states.shape[1]].transpose(1, 2)

    wrapped = _per_document_forward(conv, causal_conv)
    batch = collate_packed([{"input_ids": [5] * n} for n in (3, 4)])
    enter_forward(None, (), {PACKED_BATCH_KWARG: batch})
    try:
        row = torch.randn(1, 7, 4)  # the packed stream: split at the document bound
        expected = torch.cat([causal_conv(row[:, :3]), causal_conv(row[:, 3:])], dim=1)
        torch.testing.assert_close(wrapped(row), expected)
        assert not torch.allclose(wrapped(row), causal_conv(row))
        audio = torch.randn(1, 11, 4)  # another sequence: untouched
        torch.testing.assert_close(wrapped(audio), causal_conv(audio))
    finally:
        leave_forward(None, (), {}, None)
