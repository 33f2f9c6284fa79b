"""GPU-only, with liger-kernel installed: Liger's fused RMSNorm / SwiGLU / RoPE compute what the
model's own modules compute on a packed batch (per-document positions), and undo is exact."""

import pytest
import torch

import slipstream
from slipstream.models import build_model
from tests.conftest import random_docs

pytestmark = pytest.mark.gpu
pytest.importorskip("liger_kernel", reason="liger-kernel is not installed")

LENGTHS = [300, 129, 77, 500]  # packed: position_ids restart at 0 for each document


def _stock_then_fused(family: str, batch) -> tuple[torch.nn.Module, list[tuple]]:
    """(logits, loss, gradients) of the stock modules, then of Liger's on the same model: one model,
    since Liger's RoPE swap is module-wide (a second model of the type would run it too)."""
    model = build_model(family, dtype=torch.bfloat16).cuda().train()
    results = []
    for mode in ("off", "liger"):
        slipstream.optimize(model, fused_kernels=mode)
        with torch.no_grad():
            logits = model(**batch.model_inputs()).logits.float()
        results.append((logits, *_loss_and_grads(model, batch)))
    return model, results


def _loss_and_grads(model, batch):
    model.zero_grad(set_to_none=True)
    loss = model(**batch.model_inputs()).loss
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_liger_kernels_match_the_stock_modules_on_a_packed_batch(family):
    batch = slipstream.collate_packed(random_docs(LENGTHS), device="cuda")
    model, [(stock_logits, stock_loss, stock_grads), (fused_logits, fused_loss, fused_grads)] = (
        _stock_then_fused(family, batch)
    )
    state = slipstream.state_of(model)
    assert state.fused_kernels == "liger"
    assert any(p.startswith("fused kernels: liger (rms_norm, swiglu, rope") for p in state.policies)
    assert "Liger" in type(model.model.norm).__name__ or "forward" in vars(model.model.norm)
    torch.testing.assert_close(fused_logits, stock_logits, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(fused_loss, stock_loss, rtol=1e-2, atol=1e-2)
    assert fused_grads.keys() == stock_grads.keys()
    for name, grad in stock_grads.items():
        error = (fused_grads[name].float() - grad.float()).norm() / grad.float().norm().clamp_min(1e-12)
        assert error < 5e-2, f"{name}: relative gradient error {error:.3g}"


def test_turning_liger_off_puts_back_the_stock_modules_exactly():
    batch = slipstream.collate_packed(random_docs(LENGTHS), device="cuda")
    model, [(stock_logits, *_), _] = _stock_then_fused("qwen3", batch)
    slipstream.optimize(model, fused_kernels="off")
    assert "forward" not in vars(model.model.norm)
    with torch.no_grad():
        torch.testing.assert_close(model(**batch.model_inputs()).logits.float(), stock_logits, rtol=0, atol=0)
