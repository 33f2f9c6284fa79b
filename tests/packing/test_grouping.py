"""Documents grouped by length into a few batched SDPA calls compute what one call each computes."""

import pytest
import torch

import slipstream
from slipstream.bench.compat import documents, reference, run_arm
from slipstream.bench.counters import HostSyncCounter
from slipstream.models import build_model
from slipstream.models.tiny_any import tiny_model
from slipstream.packing import attention as attention_module
from slipstream.packing import collate_padded
from slipstream.packing.grouping import MAX_GROUPS, MAX_PADDING, document_groups, plan_groups
from tests.conftest import random_docs

# Very different lengths, length-1 documents among them, several past the tiny window (8).
LENGTHS = [1, 23, 5, 1, 40, 9, 17, 1, 30, 12, 2, 33]
CHAT_ROW = [90, 84, 97, 71, 102, 88, 93, 79, 95, 86, 91]  # ~11 chat turns of ~90 tokens


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual - expected).norm() / expected.norm().clamp_min(1e-12)).item()


@pytest.mark.parametrize(
    "lengths", [LENGTHS, CHAT_ROW, [1] * 50, [1000, 3, 4, 5, 6, 7], list(range(1, 60)), [7, 7, 7]]
)
def test_a_plan_covers_every_document_once_within_its_bounds(lengths):
    groups = plan_groups(tuple(lengths))
    assert groups is not None and len(groups) <= MAX_GROUPS
    assert sorted(d for group in groups for d in group) == list(range(len(lengths)))
    real = sum(n * n for n in lengths)
    padded = sum(len(g) * max(lengths[d] for d in g) ** 2 for g in groups)
    assert padded <= (1 + MAX_PADDING) * real


def test_auto_groups_a_chat_row_and_leaves_a_few_long_documents_alone():
    chat = slipstream.collate_packed(random_docs(CHAT_ROW))
    groups = document_groups(chat, "auto")
    assert groups is not None and len(groups.shapes) <= len(CHAT_ROW) / 2
    assert groups.padded_elements <= (1 + MAX_PADDING) * groups.real_elements
    assert document_groups(chat, "auto") is groups  # built once per batch
    assert document_groups(chat, "per_document") is None
    few = slipstream.collate_packed(random_docs([11, 21, 16]))
    assert document_groups(few, "auto") is None  # two calls for three documents: not worth a gather
    assert document_groups(few, "grouped") is not None


def _pair(family: str, grouping: str):
    stock = build_model(family, attn_implementation="eager")
    fast = build_model(family, attn_implementation="eager")
    fast.load_state_dict(stock.state_dict())
    slipstream.optimize(fast, attention_grouping=grouping, chunked_loss=False)
    return stock, fast


def _grads(model):
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen3-sliding", "gpt-oss"])
def test_grouped_matches_per_document_and_stock_in_fp32(family, monkeypatch):
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
    for grouping in ("grouped", "per_document"):
        model = build_model("qwen3").to(torch.bfloat16)
        torch.manual_seed(0)
        slipstream.optimize(model, attention_grouping=grouping, chunked_loss=False)
        models[grouping] = model
    models["per_document"].load_state_dict(models["grouped"].state_dict())
    results = {}
    for grouping, model in models.items():
        out = model(**batch.model_inputs())
        out.loss.backward()
        results[grouping] = (out.logits.float(), _grads(model))
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


@pytest.mark.parametrize("grouping", ["auto", "grouped"])
def test_grouped_forward_backward_has_no_host_sync(grouping):
    model = build_model("qwen3")
    slipstream.optimize(model, attention_grouping=grouping)
    batch = slipstream.collate_packed(random_docs(CHAT_ROW[:6] + [1, 1, 3]))
    assert document_groups(batch, grouping) is not None
    with HostSyncCounter() as syncs:
        model(**batch.model_inputs()).loss.backward()
    assert syncs.total == 0, dict(syncs.by_op)
