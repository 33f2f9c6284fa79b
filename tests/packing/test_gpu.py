"""GPU-only: a packed training step makes no host sync and runs the varlen flash backend."""

import pytest
import torch

import slipstream
from slipstream.models import build_model
from tests.conftest import random_docs

pytestmark = pytest.mark.gpu


def test_packed_step_under_sync_debug_error_uses_varlen():
    model = build_model("qwen3", dtype=torch.bfloat16).cuda().train()
    slipstream.optimize(model)
    assert model.config._attn_implementation == "slipstream_varlen"
    batch = slipstream.collate_packed(random_docs([300, 129, 77, 500]), device="cuda")
    model(**batch.model_inputs()).loss.backward()  # warm-up: kernels load, allocator grows
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = model(**batch.model_inputs())
        out.loss.backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


def test_varlen_matches_per_document_sdpa_on_gpu():
    ref = build_model("qwen3", dtype=torch.bfloat16).cuda()
    fast = build_model("qwen3", dtype=torch.bfloat16).cuda()
    fast.load_state_dict(ref.state_dict())
    slipstream.optimize(ref, attention_backend="sdpa")
    slipstream.optimize(fast, attention_backend="varlen")
    batch = slipstream.collate_packed(random_docs([300, 129, 77, 500]), device="cuda")
    with torch.no_grad():
        torch.testing.assert_close(
            fast(**batch.model_inputs()).logits, ref(**batch.model_inputs()).logits, rtol=2e-2, atol=2e-2
        )
