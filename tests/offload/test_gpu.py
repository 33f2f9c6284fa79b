"""GPU only: the CUDA engine runs the offload schedule and computes what recompute computes."""

import pytest
import torch

import slipstream
from slipstream.models import build_model
from tests.conftest import random_docs

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("mode", ["offload", "offload-double"])
def test_cuda_offload_matches_recompute_and_survives_inference_mode(mode):
    grads = {}
    for arm in ("recompute", mode):
        model = build_model("qwen3", layers=4, seed=0).cuda().train()
        slipstream.optimize(model, checkpointing=arm)
        assert model.slipstream.checkpointing == arm
        batch = slipstream.collate_packed(random_docs([300, 500, 224]), device="cuda")
        with torch.inference_mode():  # an evaluation between steps must not poison the buffers
            model.eval()
            model(**batch.model_inputs())
            model.train()
        model(**batch.model_inputs()).loss.backward()
        grads[arm] = {n: p.grad for n, p in model.named_parameters()}
    for name, grad in grads["recompute"].items():
        torch.testing.assert_close(grads[mode][name], grad, rtol=1e-5, atol=1e-6)
