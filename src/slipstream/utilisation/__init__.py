"""Utilisation: the model FLOPs of a step (``flops``) and the device's measured matmul peak (``peak``).

MFU = model FLOPs per step / step time / measured peak; ``slipstream ab`` and ``train`` report it.
"""

from .flops import FlopProfile, docs_micro_batch, flop_profile, mfu
from .peak import matmul_peak, measure_matmul_peak

__all__ = ["FlopProfile", "docs_micro_batch", "flop_profile", "matmul_peak", "measure_matmul_peak", "mfu"]
