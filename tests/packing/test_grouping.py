"""Documents grouped by length into a few batched SDPA calls compute what one call each computes."""

import dataclasses

import pytest
import torch

import slipstream
from slipstream.bench.counters import HostSyncCounter
from slipstream.compat import documents, reference, run_arm
from slipstream.models import build_model
from slipstream.models.tiny_any import tiny_model
from slipstream.packing import calibration, collate_padded
from slipstream.packing.attention import sdpa as attention_module
from slipstream.packing.costs import BUILTIN
from slipstream.packing.grouping import document_groups, plan_groups
from tests.conftest import random_docs

# Very different lengths, length-1 documents among them, several past the tiny window (8).
LENGTHS = [1, 23, 5, 1, 40, 9, 17, 1, 30, 12, 2, 33]
CHAT_ROW = [90, 84, 97, 71, 102, 88, 93, 79, 95, 86, 91]  # ~11 chat turns of ~90 tokens


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual - expected).norm() / expected.norm().clamp_min(1e-12)).item()


QWEN3_06B = (16, 8, 128)  # heads, KV heads, head_dim
DEMO = (4, 2, 32)


@pytest.mark.parametrize(
    "lengths", [LENGTHS, CHAT_ROW, [1] * 50, [1000, 3, 4, 5, 6, 7], list(range(1, 60)), [7, 7, 7]]
)
@pytest.mark.parametrize("call_elements", [0.0, 300.0, 5000.0, 1e9])
def test_a_plan_covers_every_document_once_at_the_least_modelled_cost(lengths, call_elements):
    groups, cost = plan_groups(tuple(lengths), call_elements)
    assert sorted(d for group in groups for d in group) == list(range(len(lengths)))
    padded = sum(len(g) * max(lengths[d] for d in g) ** 2 for g in groups)
    assert cost == pytest.approx(len(groups) * call_elements + padded)
    per_length = len(set(lengths)) * call_elements + sum(n * n for n in lengths)  # one group a length
    one_group = call_elements + len(lengths) * max(lengths) ** 2
    assert cost <= min(per_length, one_group) + 1e-6
    if call_elements == 0.0:
        assert padded == sum(n * n for n in lengths)  # calls are free: no padding at all
    if call_elements == 1e9:
        assert len(groups) == 1


def test_auto_follows_the_measured_cost_model():
    """Qwen3-0.6B heads on ~90-token chat turns: the FLOPs dominate, one call each (measured faster);
    the same row with the demo's small heads, or many short documents: grouped."""
    chat = slipstream.collate_packed(random_docs(CHAT_ROW))
    assert document_groups(chat, "auto", *QWEN3_06B) is None
    assert document_groups(chat, "per_document", *DEMO) is None
    short = slipstream.collate_packed(random_docs([8] * 128))
    groups = document_groups(short, "auto", *DEMO)
    assert groups is not None and groups.shapes == ((128, 8),)
    assert document_groups(short, "auto", *DEMO) is groups  # built once per batch and shape
    assert document_groups(chat, "grouped", *QWEN3_06B) is not None  # forced
    mixed = slipstream.collate_packed(random_docs(LENGTHS))
    groups = document_groups(mixed, "grouped", *DEMO)
    assert groups.padded_elements > groups.real_elements  # padded, and still exact (below)


def _pair(family: str, grouping: str):
    stock = build_model(family, attn_implementation="eager")
    fast = build_model(family, attn_implementation="eager")
    fast.load_state_dict(stock.state_dict())
    slipstream.optimize(fast, attention_grouping=grouping, chunked_loss=False)
    return stock, fast


def _grads(model):
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("call_seconds", [BUILTIN.call_seconds, 1e-7])  # one group; several
@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen3-sliding", "gpt-oss"])
def test_grouped_matches_per_document_and_stock_in_fp32(family, call_seconds, monkeypatch):
    costs = dataclasses.replace(BUILTIN, call_seconds=call_seconds)
    monkeypatch.setattr(calibration, "attention_costs", lambda *args, **kwargs: costs)
    docs = random_docs(LENGTHS, seed=3)
    batch = slipstream.collate_packed(docs)
    stock, grouped = _pair(family, "grouped")
    per_document = build_model(family, attn_implementation="eager")
    per_document.load_state_dict(stock.state_dict())
    slipstream.optimize(per_document, attention_grouping="per_document", chunked_loss=False)
    assert any(p.startswith("packed attention grouping: grouped") for p in grouped.slipstream.policies)

    calls = []
    original = attention_module.run_grouped
    monkeypatch.setattr(attention_module, "run_grouped", lambda *a, **k: calls.append(1) or original(*a, **k))
    outputs = {}
    for label, model, inputs in [
        ("grouped", grouped, batch.model_inputs()),
        ("per_document", per_document, batch.model_inputs()),
        ("stock", stock, collate_padded(docs)),
    ]:
        model.zero_grad()
        out = model(**inputs)
        out.loss.backward()
        outputs[label] = (out.loss.detach(), out.logits.detach(), _grads(model))
    assert calls  # the grouped path ran (and only for the grouped model)
    loss, logits, grads = outputs["grouped"]
    for other in ("per_document", "stock"):
        other_loss, other_logits, other_grads = outputs[other]
        assert relative_error(loss, other_loss) <= 1e-5, other
        assert grads.keys() == other_grads.keys()
        for name, grad in grads.items():
            assert relative_error(grad, other_grads[name]) <= 1e-5, f"{family} vs {other}: {name}"
    _, per_doc_logits, _ = outputs["per_document"]
    torch.testing.assert_close(logits, per_doc_logits, rtol=1e-5, atol=1e-5)
    for (start, end), row in zip(batch.doc_bounds(), outputs["stock"][1], strict=True):
        torch.testing.assert_close(logits[0, start:end], row[: end - start], rtol=1e-4, atol=1e-5)


def test_grouped_bf16_stays_within_bf16_of_per_document():
    docs = random_docs(LENGTHS, seed=4)
    batch = slipstream.collate_packed(docs)
    models = {}
    for mode in ("grouped", "per_document"):
        model = build_model("qwen3").to(torch.bfloat16)
        torch.manual_seed(0)
        slipstream.optimize(model, attention_grouping=mode, chunked_loss=False)
        models[mode] = model
    models["per_document"].load_state_dict(models["grouped"].state_dict())
    results = {}
    for mode, model in models.items():
        out = model(**batch.model_inputs())
        out.loss.backward()
        results[mode] = (out.logits.float(), _grads(model))
    assert relative_error(results["grouped"][0], results["per_document"][0]) <= 2e-2
    for name, grad in results["grouped"][1].items():
        assert relative_error(grad.float(), results["per_document"][1][name].float()) <= 5e-2, name


def test_chunked_attention_is_grouped_per_chunk_exactly():
    """Llama 4's chunked layers: the pieces of each document are what gets grouped."""
    stock = tiny_model("llama4_text")
    docs = documents(stock, lengths=(2, 21, 9, 3, 30, 17))  # 17: pieces of 8, 8 and 1
    assert max(map(len, docs)) > stock.config.attention_chunk_size
    ref = reference(stock, docs)
    result = run_arm(stock, docs, ref, {"attention_grouping": "grouped"})
    assert result.status == "pass", result.detail


@pytest.mark.parametrize("mode", ["auto", "grouped"])
def test_grouped_forward_backward_has_no_host_sync(mode):
    model = build_model("qwen3")
    slipstream.optimize(model, attention_grouping=mode)
    batch = slipstream.collate_packed(random_docs([8] * 40 + [1, 1, 3]))
    config = model.config
    shape = (config.num_attention_heads, config.num_key_value_heads, config.head_dim)
    assert document_groups(batch, mode, *shape) is not None
    with HostSyncCounter() as syncs:
        model(**batch.model_inputs()).loss.backward()
    assert syncs.total == 0, dict(syncs.by_op)


def test_the_policy_counts_batches_and_calls_grouped_or_per_document():
    """ "auto" groups the many short documents and not the Qwen3-0.6B-sized chat row; each batch is
    counted once however many layers (and forwards) read its plan, each attention call every time."""
    from slipstream.packing.costs import ATTENTION_COSTS, BUILTIN

    model = build_model("qwen3")
    slipstream.optimize(model, attention_grouping="auto")
    # the counting is under test, not this machine's calibration: the built-in costs' decisions (a
    # calibration measured beside other work can put the many short documents on either side)
    for module in [m for m in model.modules() if m in ATTENTION_COSTS]:
        ATTENTION_COSTS[module] = BUILTIN
    counts = model.slipstream.grouping_counts
    layers = model.config.num_hidden_layers
    short = slipstream.collate_packed(random_docs([8] * 40))
    one_doc = slipstream.collate_packed(random_docs([30]))
    with torch.no_grad():
        model(**short.model_inputs())
        model(**short.model_inputs())  # the same batch again: its calls count, the batch does not
        model(**one_doc.model_inputs())
    assert counts.to_dict() == {
        "batches_grouped": 1,
        "batches_per_document": 1,
        "calls_grouped": 2 * layers,
        "calls_per_document": layers,
    }
    assert counts.describe() == f"grouped 1 of 2 batches ({2 * layers} of {3 * layers} attention calls)"

    forced = build_model("qwen3")
    slipstream.optimize(forced, attention_grouping="per_document")
    with torch.no_grad():
        forced(**short.model_inputs())  # a batch another model counted is counted again here
    assert forced.slipstream.grouping_counts.to_dict() == {
        "batches_grouped": 0,
        "batches_per_document": 1,
        "calls_grouped": 0,
        "calls_per_document": layers,
    }
    assert counts.batches_grouped == 1  # the first model's counter untouched
