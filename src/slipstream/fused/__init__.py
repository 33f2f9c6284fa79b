"""Fused kernels, each behind a decider that logs why: Liger-Kernel's Triton kernels on CUDA
(``slipstream.fused.liger``), inductor-compiled RMSNorm / SwiGLU elsewhere
(``slipstream.fused.compiled``), one choice between them (``slipstream.fused.decide``)."""

from .compiled import CompiledPlan, apply_compiled, compiled_plan, compiled_policy
from .decide import FusedDecision, decide_fused_kernels
from .liger import FusedKernels, FusedKernelsUnavailable, LigerPlan, apply_liger, liger_available, liger_plan

__all__ = [
    "CompiledPlan",
    "FusedDecision",
    "FusedKernels",
    "FusedKernelsUnavailable",
    "LigerPlan",
    "apply_compiled",
    "apply_liger",
    "compiled_plan",
    "compiled_policy",
    "decide_fused_kernels",
    "liger_available",
    "liger_plan",
]
