"""Fused kernels from other libraries, each behind a decider that logs why (``slipstream.fused.liger``)."""

from .liger import (
    FusedKernels,
    FusedKernelsUnavailable,
    LigerPlan,
    apply_liger,
    liger_available,
    liger_plan,
    liger_policy,
)

__all__ = [
    "FusedKernels",
    "FusedKernelsUnavailable",
    "LigerPlan",
    "apply_liger",
    "liger_available",
    "liger_plan",
    "liger_policy",
]
