"""Utilisation: the model FLOPs of a step (``flops``), the device's measured matmul peak (``peak``)
and where a profiled step's time goes (``step_profile``).

MFU = model FLOPs per step / step time / measured peak; ``slipstream ab`` and ``train`` report it.
"""

from .flops import FlopProfile, docs_micro_batch, flop_profile, mfu
from .peak import matmul_peak, measure_matmul_peak
from .step_profile import CATEGORIES, profile_step

__all__ = [
    "CATEGORIES",
    "FlopProfile",
    "docs_micro_batch",
    "flop_profile",
    "matmul_peak",
    "measure_matmul_peak",
    "mfu",
    "profile_step",
]
