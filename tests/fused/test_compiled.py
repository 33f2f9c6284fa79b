"""Inductor-compiled RMSNorm / SwiGLU (slipstream.fused.compiled): the per-class probe that keeps
every other formula on its own forward, the decider's reasons, one graph for every packed
length, the eager formula under no_grad and dispatch modes, parity with the stock model, undo."""

from __future__ import annotations

import re

import pytest
import torch
import torch._dynamo
import torch.nn.functional as F

import slipstream
from slipstream import Speedups
from slipstream.bench.arms import preset_arms
from slipstream.bench.command import ab_config
from slipstream.bench.counters import HostSyncCounter
from slipstream.fused import FusedKernelsUnavailable, compiled_plan, compiled_policy, decide_fused_kernels
from slipstream.fused import compiled as compiled_module
from slipstream.models import build_model
from slipstream.packing import collate_packed
from tests.compile.test_regional import RecordingBackend, step, with_lora
from tests.conftest import random_docs

VOCAB = 256
BATCHES = [[5, 17, 9], [30, 12], [7, 7, 7, 7, 3], [40]]  # a new total length every batch


class LlamaStyleRMSNorm(torch.nn.Module):
    def __init__(self, width, eps=1e-6):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(width))
        self.variance_epsilon = eps

    def forward(self, hidden):
        h = hidden.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * h.to(hidden.dtype)


class OnePlusRMSNorm(LlamaStyleRMSNorm):  # Gemma: (1 + weight)
    def forward(self, hidden):
        h = hidden.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return (h * (1.0 + self.weight.float())).to(hidden.dtype)


class CastAfterRMSNorm(LlamaStyleRMSNorm):  # OLMo2 / GPT-OSS: the multiply before the cast
    def forward(self, hidden):
        h = hidden.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return (self.weight * h).to(hidden.dtype)


class GatedRMSNorm(LlamaStyleRMSNorm):  # Zamba2 / Qwen3-Next: a gate beside the hidden states
    def forward(self, hidden, gate=None):
        out = super().forward(hidden)
        return out if gate is None else out * F.silu(gate)


class GatedMLP(torch.nn.Module):
    def __init__(self, width=16, inner=32, act=F.silu):
        super().__init__()
        self.gate_proj = torch.nn.Linear(width, inner, bias=False)
        self.up_proj = torch.nn.Linear(width, inner, bias=False)
        self.down_proj = torch.nn.Linear(inner, width, bias=False)
        self.act_fn = act

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class Stack(torch.nn.Module):
    def __init__(self, *modules):
        super().__init__()
        self.parts = torch.nn.ModuleList(modules)


@pytest.fixture
def recording(monkeypatch):
    """The kernels compiled by a recording backend (eager kernels): the wiring without inductor."""
    torch._dynamo.reset()
    backend = RecordingBackend()
    monkeypatch.setattr(compiled_module, "BACKEND", backend)
    yield backend
    torch._dynamo.reset()


def test_the_probe_switches_only_classes_bit_identical_to_the_stock_formula():
    plan = compiled_plan(
        Stack(
            LlamaStyleRMSNorm(16),
            OnePlusRMSNorm(16),
            CastAfterRMSNorm(16),
            GatedRMSNorm(16),
            GatedMLP(),
            GatedMLP(act=F.gelu),
        )
    )
    assert list(plan.norms) == ["LlamaStyleRMSNorm"]
    assert plan.refused["OnePlusRMSNorm"].startswith("its forward is not the Llama-style RMSNorm")
    assert plan.refused["CastAfterRMSNorm"].startswith("its forward is not the Llama-style RMSNorm")
    # the same formula without a gate, but a caller may pass one: the signature decides
    assert plan.refused["GatedRMSNorm"] == "its forward takes more than the hidden states"
    assert list(plan.mlps) == ["GatedMLP"] and len(plan.mlps["GatedMLP"]) == 2  # one class, probed once
    # the second instance's GELU is not probed separately: a class is one verdict, the first instance's
    gelu_only = compiled_plan(Stack(GatedMLP(act=F.gelu)))
    assert (
        gelu_only.mlps == {}
        and "not down_proj(silu(gate_proj(x)) * up_proj(x))" in gelu_only.refused["GatedMLP"]
    )


def test_real_architectures_get_the_kernels_only_where_their_formulas_match():
    from slipstream.models.tiny_any import tiny_model

    llama = compiled_plan(build_model("llama", vocab_size=VOCAB, layers=2))
    assert set(llama.norms) == {"LlamaRMSNorm"} and set(llama.mlps) == {"LlamaMLP"} and not llama.refused
    gemma = compiled_plan(tiny_model("gemma"))
    assert not gemma.norms and not gemma.mlps
    assert set(gemma.refused) == {"GemmaRMSNorm", "GemmaMLP"}  # (1 + weight); GELU-tanh
    olmo2 = compiled_plan(tiny_model("olmo2"))
    assert "Olmo2RMSNorm" in olmo2.refused and set(olmo2.mlps) == {"Olmo2MLP"}  # cast after the multiply


def test_a_forward_another_tool_replaced_is_left_alone():
    norm = LlamaStyleRMSNorm(16)
    norm.forward = lambda hidden: hidden  # what an accelerate hook does
    plan = compiled_plan(Stack(norm))
    assert (
        plan.norms == {}
        and plan.refused["LlamaStyleRMSNorm"] == "its forward is already replaced on the instance"
    )


def test_auto_compiles_only_where_the_run_pays_back_the_cold_start(monkeypatch):
    break_even = compiled_module.BREAK_EVEN_STEPS["cpu"]
    assert compiled_policy("cpu", "auto", None) == (
        False,
        "compiled: the run's step count is unknown here, so a cold start could not pay back",
    )
    use, why = compiled_policy("cpu", "auto", break_even - 1)
    assert not use and f"fewer than the {break_even} that pay back the cold start on cpu" in why
    use, why = compiled_policy("cpu", "auto", break_even)
    assert use and why.startswith(f"auto: {break_even} steps")
    use, why = compiled_policy("cuda", "auto", 10_000)
    assert not use and "no measured break-even on cuda" in why
    assert compiled_policy("cpu", "off", 10_000) == (False, "requested")
    monkeypatch.setattr("slipstream.compile.inductor_available", lambda device: (False, "no C++ compiler"))
    assert compiled_policy("cpu", "auto", 10_000) == (False, "no C++ compiler")
    with pytest.raises(
        FusedKernelsUnavailable, match=re.escape("fused_kernels='compiled': no C++ compiler.")
    ):
        decide_fused_kernels(build_model("llama", vocab_size=VOCAB, layers=1), "cpu", "compiled")


def test_the_policy_line_names_each_reason():
    model = build_model("llama", vocab_size=VOCAB, layers=2)
    slipstream.optimize(model)
    policy = [p for p in slipstream.state_of(model).policies if p.startswith("fused kernels")]
    assert policy == [
        "fused kernels: off (auto: Liger: cpu — Liger-Kernel's kernels are Triton, CUDA only; "
        "compiled: the run's step count is unknown here, so a cold start could not pay back)"
    ]
    slipstream.optimize(model, expected_steps=10_000)
    state = slipstream.state_of(model)
    assert state.fused_kernels == "compiled"
    said = "fused kernels: compiled (inductor: RMSNorm x5 (LlamaRMSNorm); SwiGLU x2 (LlamaMLP)) (auto: 10000 steps"
    assert any(p.startswith(said) for p in state.policies)


def test_the_ablation_keeps_its_fused_arm_on_a_cpu_only_where_the_kernels_would_run():
    assert "slipstream-no-fused-kernels" not in preset_arms("ablation", ab_config(steps=12), "cpu")
    assert "slipstream-no-fused-kernels" in preset_arms("ablation", ab_config(steps=500), "cpu")
    forced = ab_config(steps=12, speedups={"fused_kernels": "compiled"})
    assert "slipstream-no-fused-kernels" in preset_arms("ablation", forced, "cpu")


def _pair(dtype, fused_kernels="compiled"):
    models = []
    for kernels in ("off", fused_kernels):
        model = build_model("llama", vocab_size=VOCAB, seed=0, layers=2, dtype=dtype)
        slipstream.optimize(model, Speedups().replace(fused_kernels=kernels))
        models.append(with_lora(model))
    return models


def test_one_graph_each_for_every_packed_length_and_the_same_numbers(recording):
    eager, fused = _pair(torch.float32)
    for index, lengths in enumerate(BATCHES):
        want, want_grads = step(eager, lengths, seed=index)
        got, got_grads = step(fused, lengths, seed=index)
        torch.testing.assert_close(got, want, rtol=0, atol=0)  # eager kernels: the same forward
        for name in want_grads:  # AOT autograd derives its own backward: the same up to rounding
            torch.testing.assert_close(got_grads[name], want_grads[name], rtol=1e-4, atol=1e-8)
    # one dynamic-shape graph each, whatever the packed length: SwiGLU, RMSNorm, and RMSNorm on the
    # embeddings (the first layer's input needs no gradient under LoRA: a graph of its own)
    assert recording.compiles == 3


def test_no_grad_and_dispatch_modes_take_the_eager_formula(recording):
    _, fused = _pair(torch.float32)
    batch = collate_packed(random_docs([6, 9], vocab_size=VOCAB, seed=0))
    with torch.no_grad():
        fused(**batch.model_inputs())  # evaluation / generation: never another graph
    assert recording.compiles == 0
    with HostSyncCounter() as counter:
        fused(**batch.model_inputs()).loss.backward()  # dynamo would mark the frame eager for good
    assert recording.compiles == 0 and counter.total == 0
    fused(**batch.model_inputs()).loss.backward()
    assert recording.compiles == 3  # outside both, training compiles as usual


def test_undo_gives_every_module_its_own_forward_back(recording):
    model = build_model("llama", vocab_size=VOCAB, layers=2)
    slipstream.optimize(model, fused_kernels="compiled")
    switched = [m for m in model.modules() if "forward" in vars(m)]
    assert len(switched) == 7  # 5 norms, 2 MLPs
    slipstream.state_of(model).undo()
    assert not any("forward" in vars(m) for m in model.modules())


@pytest.mark.slow  # an inductor build (about 30 s on 2 cores): run by .ci/run (make compile-check)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_inductor_kernels_match_the_stock_model_within_the_dtype(dtype):
    torch._dynamo.reset()
    eager, fused = _pair(dtype)
    reference, _ = _pair(torch.float32, fused_kernels="off")  # what bf16 is measured against
    for index, lengths in enumerate(BATCHES[:2]):
        want, want_grads = step(eager, lengths, seed=index)
        got, got_grads = step(fused, lengths, seed=index)
        if dtype == torch.float32:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            for name in want_grads:
                torch.testing.assert_close(got_grads[name], want_grads[name], rtol=1e-4, atol=1e-5)
            continue
        truth, _ = step(reference, lengths, seed=index)
        # bf16: the fused loss no further from fp32 than the stock bf16 loss, with a bf16 ulp of room
        assert abs(got.float() - truth) <= abs(want.float() - truth) + 2**-7 * abs(truth)
