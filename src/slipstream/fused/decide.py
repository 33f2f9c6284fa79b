"""The one decider for ``Speedups.fused_kernels``: Liger's Triton kernels, inductor-compiled
ones, or the model's own modules, and why (``slipstream.fused``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..refusal import optimize_call
from .compiled import CompiledPlan, apply_compiled, compiled_plan, compiled_policy
from .liger import FusedKernelsUnavailable, LigerPlan, apply_liger, liger_plan


@dataclass
class FusedDecision:
    """``kind``: "liger", "compiled" or None (the model's own modules); ``why``: the policy line."""

    kind: str | None
    why: str
    liger: LigerPlan | None = None
    compiled: CompiledPlan | None = None

    def apply(self, model: torch.nn.Module) -> Callable[[], None] | None:
        """Switch the kernels on ``model`` (the transformers model); returns the undo."""
        if self.liger is not None:
            return apply_liger(model, self.liger)
        if self.compiled is not None:
            return apply_compiled(self.compiled)
        return None


def decide_fused_kernels(
    model: torch.nn.Module, device: torch.device | str, mode: str = "auto", expected_steps: int | None = None
) -> FusedDecision:
    """ "auto": Liger where it runs (CUDA, installed, the model type known), else the compiled
    kernels where their break-even is measured and the run pays it back, else off, saying why
    for each. "liger" / "compiled" insist (:class:`FusedKernelsUnavailable` names why they
    cannot); "off" keeps the model's own modules. Compiled kernels are probed per module class
    here, so a model with no matching class gets them nowhere and the line says so."""
    if mode == "off":
        return FusedDecision(None, "off (requested)")
    liger_why = ""
    if mode in ("auto", "liger"):
        plan, liger_why = liger_plan(model, device, mode)  # raises for "liger" where it cannot run
        if plan is not None:
            return FusedDecision("liger", liger_why, liger=plan)
        liger_why = liger_why.removeprefix("off (auto: ").removesuffix(")")
    wanted, why = compiled_policy(device, mode, expected_steps)
    if mode == "compiled" and not wanted:
        raise FusedKernelsUnavailable(
            f"fused_kernels='compiled': {why}. Use {optimize_call(FusedKernelsUnavailable.avoid)} (on only where "
            "it pays), or fused_kernels='off'.",
            refused=f"fused_kernels='compiled' ({why})",
        )
    if not wanted:
        return FusedDecision(None, f"off (auto: Liger: {liger_why}; {why})")
    plan = compiled_plan(model)
    if not plan.norms and not plan.mlps:
        return FusedDecision(None, f"off ({plan.describe()})")
    return FusedDecision("compiled", f"{plan.describe()} ({why})", compiled=plan)
