"""Liger-Kernel's fused kernels (slipstream.fused.liger): the decider and its reasons, the call on
the base model (never the loss), the forced mode's errors, and the undo; on CPU and fake CUDA,
with a recording stand-in for ``liger_kernel`` (the real one needs Triton and a GPU)."""

from __future__ import annotations

import importlib.machinery
import inspect
import sys
import types

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers.models.llama import modeling_llama

import slipstream
from slipstream import Speedups
from slipstream.fused import FusedKernelsUnavailable, liger_plan
from slipstream.models import build_model
from tests.fake_cuda import fake_cuda, requires_fake_cuda, tiny_cuda_model

CUDA = torch.device("cuda")


def _fake_rope(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    return q, k


class _FakeRMSNorm(torch.nn.Module):
    pass


def _fake_forward(self, x):
    return x


def _apply_to_llama(
    rope=True, cross_entropy=False, fused_linear_cross_entropy=True, rms_norm=True, swiglu=True, model=None
):
    """Does what Liger's apply_liger_kernel_to_llama does, with stand-ins: module-wide swaps of the
    RoPE function and the norm class, then each instance's norms and MLPs bound to new forwards."""
    if rope:
        modeling_llama.apply_rotary_pos_emb = _fake_rope
    if rms_norm:
        modeling_llama.LlamaRMSNorm = _FakeRMSNorm
    assert not fused_linear_cross_entropy and not cross_entropy, "slipstream's loss must stay"
    inner = getattr(model, model.base_model_prefix, model)
    for module in inner.modules():
        if rms_norm and type(module).__name__ == "LlamaRMSNorm":
            module.offset, module.casting_mode = 0.0, "llama"
            module.__dict__["forward"] = _fake_forward.__get__(module)
        if swiglu and type(module).__name__ == "LlamaMLP":
            module.__dict__["forward"] = _fake_forward.__get__(module)


def _apply_to_qwen3_moe(
    rope=True, cross_entropy=False, fused_linear_cross_entropy=True, rms_norm=True, swiglu=True, model=None
):
    pass


def _apply_with_an_unknown_switch(rope=True, rms_norm=True, relu_squared=True, model=None):
    pass


@pytest.fixture
def fake_liger(monkeypatch):
    """A ``liger_kernel`` in sys.modules whose ``_apply_liger_kernel_to_instance`` records each call
    and, like Liger's, filters the switches by the apply function's signature."""
    calls = []
    table = {
        "llama": _apply_to_llama,
        "qwen3_moe": _apply_to_qwen3_moe,
        "qwen3": _apply_with_an_unknown_switch,
    }

    def apply_to_instance(model, **kwargs):
        calls.append((model, kwargs))
        apply_fn = table[model.config.model_type]
        accepted = inspect.signature(apply_fn).parameters
        apply_fn(model=model, **{k: v for k, v in kwargs.items() if k in accepted})

    package = types.ModuleType("liger_kernel")
    package.__spec__ = importlib.machinery.ModuleSpec("liger_kernel", None)
    package.__version__ = "0.0-fake"
    transformers_module = types.ModuleType("liger_kernel.transformers")
    monkey_patch = types.ModuleType("liger_kernel.transformers.monkey_patch")
    monkey_patch.MODEL_TYPE_TO_APPLY_LIGER_FN = {"llama": _apply_to_llama, "qwen3_moe": _apply_to_qwen3_moe}
    monkey_patch._apply_liger_kernel_to_instance = apply_to_instance
    for name, module in [
        ("liger_kernel", package),
        ("liger_kernel.transformers", transformers_module),
        ("liger_kernel.transformers.monkey_patch", monkey_patch),
    ]:
        monkeypatch.setitem(sys.modules, name, module)
    # put back what a failing test's fake apply left module-wide
    monkeypatch.setattr(modeling_llama, "apply_rotary_pos_emb", modeling_llama.apply_rotary_pos_emb)
    monkeypatch.setattr(modeling_llama, "LlamaRMSNorm", modeling_llama.LlamaRMSNorm)
    monkey_patch.table = table
    return calls


def test_stock_has_fused_kernels_off_and_the_default_is_auto():
    assert Speedups.stock().fused_kernels == "off"
    assert Speedups().fused_kernels == "auto"


def test_on_cpu_auto_is_off_and_says_why():
    model = build_model("llama")
    slipstream.optimize(model)
    policy = [p for p in slipstream.state_of(model).policies if p.startswith("fused kernels")]
    assert policy == [
        "fused kernels: off (auto: Liger: cpu — Liger-Kernel's kernels are Triton, CUDA only; "
        "compiled: the run's step count is unknown here, so a cold start could not pay back)"
    ]
    assert liger_plan(model, "cpu", "off") == (None, "off (requested)")


def test_forced_on_cpu_raises_naming_the_reason(fake_liger):
    model = build_model("llama")
    with pytest.raises(FusedKernelsUnavailable, match="cpu — Liger-Kernel's kernels are Triton, CUDA only"):
        slipstream.optimize(model, fused_kernels="liger")
    assert fake_liger == []


def test_not_installed_is_off_in_auto_and_an_error_when_forced(monkeypatch):
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    model = build_model("llama")
    plan, why = liger_plan(model, CUDA, "auto")
    assert plan is None and "liger-kernel is not installed" in why
    with pytest.raises(FusedKernelsUnavailable, match="liger-kernel is not installed"):
        liger_plan(model, CUDA, "liger")


def test_an_unsupported_model_type_is_named(fake_liger):
    model = build_model("qwen3")  # not in the fake's MODEL_TYPE_TO_APPLY_LIGER_FN
    assert liger_plan(model, CUDA, "auto") == (
        None,
        "off (auto: Liger-Kernel has no kernels for model type 'qwen3')",
    )
    with pytest.raises(FusedKernelsUnavailable, match="no kernels for model type 'qwen3'"):
        liger_plan(model, CUDA, "liger")


def test_the_plan_never_touches_the_loss_and_names_what_it_leaves_off(fake_liger):
    plan, why = liger_plan(build_model("llama"), CUDA, "auto")
    assert plan.kwargs == {
        "rope": True,
        "cross_entropy": False,
        "fused_linear_cross_entropy": False,
        "rms_norm": True,
        "swiglu": True,
    }
    assert why.startswith("liger (rms_norm, swiglu, rope; liger_kernel 0.0-fake;")
    assert "the loss stays slipstream's" in why
    moe, why = liger_plan(build_model("qwen3-moe"), CUDA, "auto")  # SwiGLU would bind over the experts
    assert moe.kwargs["swiglu"] is False and "swiglu left off" in why
    sys.modules["liger_kernel.transformers.monkey_patch"].MODEL_TYPE_TO_APPLY_LIGER_FN["qwen3"] = (
        _apply_with_an_unknown_switch
    )
    unknown, why = liger_plan(build_model("qwen3"), CUDA, "auto")
    assert unknown.kwargs == {"rope": True, "rms_norm": True, "relu_squared": False}
    assert "relu_squared left off: not checked by slipstream" in why


@requires_fake_cuda
def test_on_fake_cuda_auto_applies_liger_to_the_base_model_and_undo_restores_it(fake_liger):
    stock_rope, stock_norm_class = modeling_llama.apply_rotary_pos_emb, modeling_llama.LlamaRMSNorm
    with fake_cuda():
        model = base = tiny_cuda_model("llama")
        slipstream.optimize(model, Speedups.stock().replace(fused_kernels="auto"))
        state = slipstream.state_of(model)
        assert len(fake_liger) == 1
        called_with, kwargs = fake_liger[0]
        assert called_with is base
        assert kwargs["cross_entropy"] is False and kwargs["fused_linear_cross_entropy"] is False
        assert state.fused_kernels == "liger"
        policy = [p for p in state.policies if p.startswith("fused kernels")]
        assert policy[-1].startswith("fused kernels: liger (rms_norm, swiglu, rope; liger_kernel 0.0-fake")
        norm, mlp = base.model.norm, base.model.layers[0].mlp
        assert "forward" in vars(norm) and "forward" in vars(mlp) and norm.casting_mode == "llama"
        assert modeling_llama.apply_rotary_pos_emb is _fake_rope  # looked up at call time: kept while on
        assert modeling_llama.LlamaRMSNorm is stock_norm_class  # a class swap: put back at once

        slipstream.optimize(model, Speedups.stock().replace(fused_kernels="auto"))  # again: applied once
        assert len(fake_liger) == 1

        state.undo()
        assert "forward" not in vars(norm) and "forward" not in vars(mlp)
        assert not hasattr(norm, "casting_mode") and not hasattr(norm, "offset")
        assert modeling_llama.apply_rotary_pos_emb is stock_rope
        assert state.fused_kernels is None
        assert "fused kernels: off (requested); the model's own modules restored" in state.policies


def test_under_peft_liger_gets_the_transformers_model(fake_liger, monkeypatch):
    """(PEFT cannot wrap a fake-CUDA model, so here the device check alone is waved through.)"""
    monkeypatch.setattr(
        "slipstream.fused.liger.liger_available", lambda device, mode: (mode != "off", "requested")
    )
    base = build_model("llama")
    model = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    slipstream.optimize(model, Speedups.stock().replace(fused_kernels="liger"))
    assert [called_with for called_with, _ in fake_liger] == [base]
    assert slipstream.state_of(model).fused_kernels == "liger"
    slipstream.state_of(model).undo()
    assert "forward" not in vars(base.model.norm)
