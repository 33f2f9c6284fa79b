"""Fused kernels: RMSNorm / SwiGLU (/ RoPE) in place of the model's own modules (never its loss),
Liger-Kernel's Triton kernels on CUDA, else inductor-compiled ones (each module class probed
bit-exact to the stock formula first) where the run's steps pay back their cold start."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from ..compile import inductor_available
from ..fused import (
    FusedKernels,
    compiled_plan,
    compiled_policy,
    decide_fused_kernels,
    liger_available,
    liger_plan,
)
from ..fused import compiled as compiled_kernels
from ..fused.compiled import BREAK_EVEN_STEPS
from .base import AblationRun, ApplyContext, DecisionContext, Option, ParityCase, Speedup
from .compile import by_run_length

# The fused kernels' torch.compile backend in the sweep: dynamo's eager backend by default (the
# probe and the swap, checked in seconds), inductor under the sweep's --compile.
SWEEP_BACKENDS = {False: "eager", True: "inductor"}


@contextlib.contextmanager
def sweep_backend(inductor: bool) -> Iterator[None]:
    """The compiled kernels built with the sweep's backend, every architecture traced afresh."""
    previous = compiled_kernels.BACKEND
    compiled_kernels.BACKEND = SWEEP_BACKENDS[inductor]
    torch._dynamo.reset()  # every architecture traced afresh, never past dynamo's recompile limit
    try:
        yield
    finally:
        compiled_kernels.BACKEND = previous


def kernels_matched(model: torch.nn.Module) -> str | None:
    """The compiled kernels the probe would switch on ``model`` ("RMSNorm+SwiGLU"), or None."""
    plan = compiled_plan(model)
    return "+".join(name for name, found in (("RMSNorm", plan.norms), ("SwiGLU", plan.mlps)) if found) or None


@dataclass
class FusedKernelsState:
    """The fused kernels on a model ("liger" / "compiled"; None: the model's own modules) and what
    puts the model's modules back."""

    kind: str | None = None
    undo: Any = field(default=None, repr=False)


class FusedKernelsSpeedup(Speedup):
    name = "fused kernels"
    stage = 60  # before compile: the graphs trace them
    options = (
        Option(
            "fused_kernels",
            FusedKernels,
            "auto",
            "fused RMSNorm / SwiGLU (/ RoPE) in place of the model's own modules (never its loss): liger "
            "(Liger-Kernel's Triton kernels, CUDA), compiled (inductor-compiled, each module class probed "
            "bit-exact to the stock formula first), auto (liger where it runs, else compiled where the run's "
            "steps pay back the cold start), off (the model's own modules); liger / compiled insist",
            stock="off",
        ),
    )
    ablation = {"fused_kernels": "off"}
    ablation_name = "fused-kernels"
    doctor_label = "fused kernels (auto)"

    def apply(self, run: ApplyContext) -> None:
        """Decided by ``fused.decide_fused_kernels`` (which raises for "liger" / "compiled" where they
        cannot run), applied to the transformers model, undone by putting back what was changed; a
        decision that differs from what is on undoes the old kernels first."""
        base, state = run.base, run.state
        own = state.of(FusedKernelsState)
        decision = decide_fused_kernels(base, run.device, run.speedups.fused_kernels, run.expected_steps)
        why = decision.why
        if own.kind is not None and own.kind != decision.kind:
            own.undo()
            own.undo = None
            own.kind = None
            if decision.kind is None:
                why += "; the model's own modules restored"
        if decision.kind is not None and own.kind is None:
            own.undo = decision.apply(base)
            own.kind = decision.kind
        state.say(f"fused kernels: {why}")

    def ablation_applies(self, run: AblationRun) -> bool:
        """Neither Liger (not CUDA, not installed) nor the compiled kernels (too few steps for their
        break-even, no inductor) would run: dropped ("off" too). A model type Liger lacks, or one
        with no module class the compiled kernels match, is only found when the arm's model is built."""
        fused, device = run.speedups.fused_kernels, run.device
        return liger_available(device, fused)[0] or compiled_policy(device, fused, run.config.ab.steps)[0]

    def decide(self, context: DecisionContext) -> tuple[str, str]:
        model, device = context.model, context.device
        plan, why = liger_plan(model, device, "auto")  # the tiny model: its config's model type
        if plan:
            return "liger", why
        return fused_compiled_decision(model, device, why.removeprefix("off (auto: ").removesuffix(")"))

    def parity_cases(self) -> tuple[ParityCase, ...]:
        return (
            ParityCase(
                "fused",
                fast={"fused_kernels": "compiled"},
                stock={},
                arms="the compiled fused kernels on every module class their probe passes vs the stock step",
                shown=kernels_matched,
                runs_in=sweep_backend,
                doctor=False,
            ),
        )


def fused_compiled_decision(model: torch.nn.Module, device: torch.device, liger_why: str) -> tuple[str, str]:
    """Where Liger cannot run: what ``fused_kernels="auto"`` does with the compiled kernels (it
    depends on the run's length, which doctor does not know), which of the model's module classes
    the probe would switch, and whether inductor can build here (nothing is compiled)."""
    break_even = BREAK_EVEN_STEPS.get(device.type)
    choice = by_run_length(break_even, "compiled")
    if break_even is None:
        why = compiled_policy(device, "auto", 2**31)[1]
    else:
        why = f"{break_even} steps pay back the kernels' cold start on {device.type} (measured; slipstream.fused.compiled)"
    works, how = inductor_available(device)
    choice += "" if works else "; fused_kernels='compiled' cannot run here"
    return choice, f"Liger: {liger_why}; {why}; {compiled_plan(model).describe()}; {how}"
