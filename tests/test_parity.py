"""The parity kit: the documents, the stock reference step, an arm's step, the comparison."""

from __future__ import annotations

import pytest
import torch

from slipstream.models.tiny_any import tiny_model
from slipstream.offload import RecordingEngine
from slipstream.optimize import state_of
from slipstream.packing.guards import UnsupportedArchitecture
from slipstream.parity import (
    LENGTHS,
    SEED,
    TOLERANCE,
    Arm,
    Step,
    compare,
    documents,
    gradient_errors,
    inputs_of,
    problems,
    reference,
)


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama", seed=SEED)


@pytest.fixture(scope="module")
def docs(llama):
    return documents(llama)


@pytest.fixture(scope="module")
def ref(llama, docs):
    return reference(llama, docs)


def test_the_documents_are_seeded_and_of_the_asked_lengths(llama):
    docs = documents(llama)
    assert [len(d) for d in docs] == list(LENGTHS) and docs == documents(llama)
    assert documents(llama, seed=1) != docs
    assert [len(d) for d in documents(llama, lengths=(3, 5))] == [3, 5]


def test_the_reference_is_each_document_alone_weighted_by_its_labels(llama, docs, ref):
    assert [tuple(logits.shape[:1]) for logits in ref.logits] == [(n,) for n in LENGTHS]
    total = sum(n - 1 for n in LENGTHS)
    with torch.no_grad():
        alone = [llama(input_ids=torch.tensor([d]), labels=torch.tensor([d])).loss.item() for d in docs]
    assert ref.loss == pytest.approx(
        sum(loss * (len(d) - 1) / total for loss, d in zip(alone, docs, strict=True)), rel=1e-6
    )
    assert ref.grads and all(g.dtype == torch.float32 for g in ref.grads.values())
    assert all(p.grad is not None for p in llama.parameters() if p.requires_grad)  # the stock model itself


def test_a_packed_arm_matches_the_reference_and_leaves_the_base_alone(llama, docs, ref):
    arm = Arm(llama).set_up({}, offload=RecordingEngine())
    step = arm.step(docs, "packed", logits=True)
    errors = compare(step, ref)
    assert problems(errors) == [], errors
    assert errors.logits is not None and errors.logits <= TOLERANCE["logits"]
    assert arm.offloaded and any(p.startswith("packed attention: slipstream") for p in arm.policies)
    assert state_of(llama) is None  # optimize ran on the copy only


def test_an_unpacked_arm_without_speedups_is_the_reference(llama, docs, ref):
    stock = {"packed_attention": False, "chunked_loss": False, "moe_routing": "stock"}
    step = Arm(llama).set_up(stock).step(docs, "alone", logits=True)
    errors = compare(step, ref)
    assert errors.loss == 0 and errors.grad == 0 and errors.worst_param is None and errors.logits == 0


def test_the_comparison_names_what_is_off(ref):
    off = {name: grad.clone() for name, grad in ref.grads.items()}
    name = sorted(off)[3]
    off[name] += 0.1 * off[name].norm() / off[name].numel() ** 0.5 + 1e-3
    logits = [x + 1.0 for x in ref.logits]
    errors = compare(Step(ref.loss * 1.001, off, logits), ref)
    assert errors.worst_param == name and errors.grad > TOLERANCE["grad"]
    found = problems(errors)
    assert found[0].startswith("logits off by") and found[1].startswith("loss off by 0.001")
    assert found[2].startswith(f"gradient of {name} off by")
    assert problems(compare(Step(float("nan"), ref.grads), ref)) == ["loss off by nan"]
    assert compare(Step(ref.loss, ref.grads), ref).logits is None  # only where both kept them


def test_gradient_errors_scale_tiny_gradients_and_flag_one_sided_ones():
    big, tiny = torch.ones(4), torch.full((4,), 1e-9)
    errors = gradient_errors({"a": big, "b": tiny * 2}, {"a": big, "b": tiny})
    assert errors["a"] == 0 and errors["b"] < 1e-4  # fp32 noise on a near-zero gradient is not a difference
    assert gradient_errors({"a": big}, {"a": big, "c": big})["c"] == float("inf")
    assert "c" not in gradient_errors({"a": big}, {"a": big, "c": torch.zeros(2)})


def test_an_arm_that_refuses_keeps_its_copy_and_what_optimize_decided():
    mamba = tiny_model("mamba", seed=SEED)
    arm = Arm(mamba)
    with pytest.raises(UnsupportedArchitecture):
        arm.set_up({})
    assert arm.model is not mamba and not arm.offloaded


def test_inputs_are_a_packed_row_or_one_row_per_document(docs):
    packed = inputs_of(docs, "packed")
    assert packed.model_inputs()["input_ids"].shape == (1, sum(LENGTHS))
    assert [ids.shape for ids in inputs_of(docs, "alone")] == [(1, n) for n in LENGTHS]
    with pytest.raises(ValueError, match="layout"):
        inputs_of(docs, "padded")
