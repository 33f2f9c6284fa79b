"""LoRA in the compute dtype: PEFT's LoRA linears computed in the activations' dtype with the
update added in one GEMM (the fp32 adapters stay the optimizer's master copy). Adapters are
attached after ``optimize`` (PEFT wraps the optimized model), so the layers are adapted on the
next forward, by a pre-hook that then removes itself; the decision joins the policy log there."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .. import lora as lora_compute
from .base import AblationRun, ApplyContext, Option, ParityCase, Speedup


@dataclass
class LoraComputeState:
    """The pre-hook that adapts a model's LoRA layers on its next forward (None once it has run)."""

    hook: Any = field(default=None, repr=False)


class LoraInComputeDtype(Speedup):
    name = "lora compute"
    stage = 40
    options = (
        Option(
            "lora_in_compute_dtype",
            bool,
            True,
            "PEFT LoRA linears computed in the activations' dtype, the update added in one GEMM (fp32 "
            "adapters stay the optimizer's master copy): no activation casts per call (false: PEFT's forward)",
            stock=False,
        ),
    )
    ablation = {"lora_in_compute_dtype": False}
    ablation_name = "lora-compute"

    def apply(self, run: ApplyContext) -> None:
        base, state = run.base, run.state
        own = state.of(LoraComputeState)
        if not run.speedups.lora_in_compute_dtype:
            if own.hook is not None:
                own.hook.remove()
                own.hook = None
            if lora_compute.uninstall(base):
                state.say("lora compute: PEFT's forward (stock)")
            return
        if own.hook is not None:
            return

        def adapt_on_first_forward(module, args, kwargs):
            own.hook.remove()
            own.hook = None
            installed, kept = lora_compute.install(base)
            if not installed and not kept:
                return  # no LoRA on this model: nothing to say
            policy = f"lora compute: activations' dtype, one fused addmm per layer ({installed} layers)"
            policy += "".join(f"; {count} keep PEFT's forward: {why}" for why, count in kept.items())
            state.say(policy)

        own.hook = base.register_forward_pre_hook(adapt_on_first_forward, with_kwargs=True)

    def ablation_applies(self, run: AblationRun) -> bool:
        return bool(run.config.lora_rank)  # a full fine-tune: the same run as slipstream's

    def parity_cases(self) -> tuple[ParityCase, ...]:
        return (
            ParityCase(
                "LoRA in compute dtype",
                fast={"lora_in_compute_dtype": True},
                stock={"lora_in_compute_dtype": False},
                arms="LoRA on every linear: in the activations' dtype, one addmm, vs PEFT's forward",
                lora=True,
                sweep=False,
            ),
        )
