"""Checkpointing changes where activations live, never the numbers: gradients bitwise equal to "off"."""

import logging

import pytest
import torch

import slipstream
from slipstream.models import build_model
from slipstream.offload import RecordingEngine, enable_checkpointing
from tests.conftest import random_docs

MODES = ["recompute", "offload", "offload-double", "offload+engine", "offload-double+engine"]


def train_three_steps(family, mode):
    model = build_model(family, attn_implementation="eager", layers=3, seed=0).train()
    slipstream.optimize(model)
    if mode.endswith("+engine"):  # the real offload schedule, on a recording CPU engine
        enable_checkpointing(
            model, mode.removesuffix("+engine"), engine=RecordingEngine(), min_offload_bytes=0
        )
    else:
        slipstream.optimize(model, checkpointing=mode)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    grads = []
    for step in range(3):
        batch = slipstream.collate_packed(random_docs([7, 20, 13, 5], seed=step))
        model(**batch.model_inputs()).loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        optimizer.step()
        optimizer.zero_grad()
    return grads


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("family", ["llama", "qwen3-moe", "gpt-oss"])
def test_every_gradient_equals_off_bitwise_over_three_steps(family, mode):
    reference = train_three_steps(family, "off")
    other = train_three_steps(family, mode)
    for step, (ref, got) in enumerate(zip(reference, other, strict=True)):
        assert ref.keys() == got.keys()
        for name in ref:
            assert torch.equal(ref[name], got[name]), f"step {step}: {name}"


def test_offload_on_cpu_falls_back_to_recompute_and_says_why(caplog):
    model = build_model("llama").train()
    with caplog.at_level(logging.INFO, logger="slipstream"):
        slipstream.optimize(model, checkpointing="offload-double")
    assert model.slipstream.checkpointing == "recompute"
    assert "no CUDA device: recompute instead" in caplog.text


@pytest.mark.parametrize("mode", ["recompute", "offload-double+engine"])
def test_lora_over_4bit_moe_experts_trains_the_same_under_checkpointing(mode):
    """Frozen (4-bit) base, LoRA adapters only: the embeddings need no gradient, so the
    checkpoint must still run its backward for the adapters inside the layers."""
    from peft import LoraConfig, get_peft_model

    from slipstream.moe.lora import add_expert_lora
    from slipstream.moe.nf4 import quantize_experts

    def lora_grads(checkpointing):
        model = build_model("qwen3-moe", layers=3, seed=0).train()
        slipstream.optimize(model)
        quantize_experts(model)
        if checkpointing.endswith("+engine"):
            enable_checkpointing(
                model, checkpointing.removesuffix("+engine"), engine=RecordingEngine(), min_offload_bytes=0
            )
        else:
            slipstream.optimize(model, checkpointing=checkpointing)
        torch.manual_seed(1)
        model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
        add_expert_lora(model, r=4)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_B" in name:
                    param.normal_(0, 0.1)
        batch = slipstream.collate_packed(random_docs([7, 20, 13]))
        model(**batch.model_inputs()).loss.backward()
        return {n: p.grad for n, p in model.named_parameters() if p.requires_grad}

    reference, other = lora_grads("off"), lora_grads(mode)
    assert reference.keys() == other.keys() and len(reference) > 4
    for name in reference:
        assert reference[name] is not None and other[name] is not None, name
        assert torch.equal(reference[name], other[name]), name
