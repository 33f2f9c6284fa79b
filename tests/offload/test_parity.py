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
    assert model.slipstream_state.checkpointing == "recompute"
    assert "no CUDA device: recompute instead" in caplog.text
