"""Values a model computes from the packed row: each adaptation makes its family exact packed (and
its absence makes it wrong), each guard refuses by name."""

from __future__ import annotations

import pytest
import torch

import slipstream
from slipstream.bench.counters import HostSyncCounter
from slipstream.compat import LENGTHS, documents, reference, run_arm
from slipstream.models.tiny_any import tiny_model
from slipstream.packing import collate_packed, rowpos, verdict
from slipstream.packing.guards import UnsupportedArchitecture


def _without_row_features(monkeypatch):
    monkeypatch.setattr(verdict, "row_position_features", lambda model: [])


def _nope_layers(model):
    return [m for m in model.modules() if getattr(m, "attn_temperature_tuning", None) is not None]


def test_llama4_temperature_tuning_is_exact_per_document(monkeypatch):
    stock = tiny_model("llama4_text")
    config = stock.config
    assert config.attn_temperature_tuning and 0 in config.no_rope_layers
    # The temperature steps every floor_scale tokens: below the row's length, so the row's
    # positions and the documents' differ.
    assert min(LENGTHS) < config.floor_scale < sum(LENGTHS)
    docs = documents(stock)
    ref = reference(stock, docs)
    adapted = run_arm(stock, docs, ref, {})  # loss, logits and every gradient vs each document alone
    assert adapted.status == "pass", adapted.detail
    assert adapted.loss_error <= 1e-6 and adapted.grad_error <= 1e-5
    assert any("temperature tuning" in p and "adapted" in p for p in adapted.policies)
    _without_row_features(monkeypatch)
    rowwise = run_arm(stock, docs, ref, {})
    assert rowwise.status == "WRONG"  # the documents after the first get another document's scale


def test_llama4_keeps_its_own_temperature_unpacked():
    stock = tiny_model("llama4_text")
    model = tiny_model("llama4_text")
    slipstream.optimize(model, chunked_loss=False)
    docs = documents(stock, lengths=(12, 30))
    with torch.no_grad():
        model(**collate_packed([{"input_ids": d} for d in docs]).model_inputs())
        assert all(m.attn_temperature_tuning for m in _nope_layers(model))  # switched back on
        assert not rowpos._ARMED
        row = torch.tensor([docs[0] + docs[1]])  # one unpacked row: the row is the document
        torch.testing.assert_close(model(input_ids=row).logits, stock(input_ids=row).logits)


def test_temperature_tuning_through_another_attention_is_refused():
    model = tiny_model("llama4_text")
    slipstream.optimize(model, chunked_loss=False)
    model.set_attn_implementation("eager")  # not slipstream's attention: nothing would scale per document
    batch = collate_packed([{"input_ids": d} for d in documents(model)])
    with pytest.raises(UnsupportedArchitecture, match="temperature tuning.*packed_attention=False"):
        model(**batch.model_inputs())
    assert all(m.attn_temperature_tuning for m in _nope_layers(model))


def test_longrope_picks_its_factors_per_document(monkeypatch):
    stock = tiny_model("phi3")
    threshold = stock.config.rope_parameters["original_max_position_embeddings"]
    assert stock.config.rope_parameters["rope_type"] == "longrope"
    assert min(LENGTHS) <= threshold < max(LENGTHS)  # documents on both sides
    docs = documents(stock)
    ref = reference(stock, docs)
    adapted = run_arm(stock, docs, ref, {})
    assert adapted.status == "pass", adapted.detail
    assert any("longrope" in p for p in adapted.policies)
    _without_row_features(monkeypatch)
    assert run_arm(stock, docs, ref, {}).status == "WRONG"  # every document got the long factors


def test_the_rotary_module_runs_once_per_run_of_documents_on_one_side(monkeypatch):
    assert rowpos._runs((11, 21, 16, 30, 5), lambda n: n > 16) == [
        (0, 11),
        (11, 32),
        (32, 48),
        (48, 78),
        (78, 83),
    ]
    assert rowpos._runs((5, 10, 20, 30), lambda n: n > 16) == [(0, 15), (15, 65)]
    model = tiny_model("phi3")
    rotary = model.model.rotary_emb
    calls, forward = [], type(rotary).forward

    def counted(self, x, position_ids, *args, **kwargs):
        calls.append(position_ids.shape[-1])
        return forward(self, x, position_ids, *args, **kwargs)

    monkeypatch.setattr(type(rotary), "forward", counted)
    slipstream.optimize(model, chunked_loss=False)
    with torch.no_grad():
        model(**collate_packed([{"input_ids": d} for d in documents(model, lengths=(5, 9))]).model_inputs())
        assert calls == [14]  # every document short: one call, as stock
        calls.clear()
        model(
            **collate_packed(
                [{"input_ids": d} for d in documents(model, lengths=(5, 9, 20, 3))]
            ).model_inputs()
        )
    assert calls == [14, 20, 3]


def test_dynamic_rope_is_exact_below_max_positions_and_refused_above():
    stock = tiny_model("hunyuan_v1_dense")
    limit = stock.config.max_position_embeddings
    assert "dynamic" in stock.config.rope_parameters["rope_type"]
    assert max(LENGTHS) < limit < sum(LENGTHS)  # a row longer than the limit, each document shorter
    docs = documents(stock)
    result = run_arm(stock, docs, reference(stock, docs), {})
    assert result.status == "pass", result.detail
    assert any("dynamic RoPE" in p for p in result.policies)
    model = tiny_model("hunyuan_v1_dense")
    slipstream.optimize(model)
    batch = collate_packed([{"input_ids": d} for d in documents(model, lengths=(5, limit))])
    with pytest.raises(UnsupportedArchitecture, match=r"dynamic RoPE.*packed_attention=False"):
        model(**batch.model_inputs())


@pytest.mark.parametrize("model_type", ["llama4_text", "phi3"])
def test_row_position_adaptations_add_no_host_sync(model_type):
    model = tiny_model(model_type)
    slipstream.optimize(model, chunked_loss=False, moe_routing="stock")
    batch = collate_packed([{"input_ids": d} for d in documents(model)])
    model(**batch.model_inputs()).loss.backward()  # first steps may probe once
    with HostSyncCounter() as syncs:
        model(**batch.model_inputs()).loss.backward()
    assert syncs.total == 0, dict(syncs.by_op)


def test_every_audit_finding_has_one_outcome_and_says_why():
    assert {f.outcome for f in rowpos.AUDIT} <= {"exact", "adapted", "guarded", "refused"}
    assert all(f.feature and f.model_types and f.why for f in rowpos.AUDIT)
    outcomes = {f.outcome for f in rowpos.AUDIT if "llama4" in f.model_types or "phi3" in f.model_types}
    assert "adapted" in outcomes


@pytest.mark.parametrize("model_type", ["phi3", "hunyuan_v1_dense"])
def test_the_rotary_frequencies_are_chosen_on_the_host_on_this_transformers(model_type):
    """The adaptation finds the rotary forward beneath transformers' ``dynamic_rope_update`` (which
    compares a device value: in Python on 5.17), so the choice is made from the host lengths on
    every version; a version without that decorator would fall back to the module's own forward."""
    rotary = tiny_model(model_type).model.rotary_emb
    assert rowpos._frequency_free_forward(rotary) is not None
