"""The registered speedups, in the order their options appear; ``optimize`` applies them by stage.

The built-in ones are listed here; another (a plug-in, a test's toy) joins with :func:`register`
and leaves with :func:`unregister`. ``Speedups``' fields follow this list (a test holds them in
step; a plug-in's come from ``speedups.build_speedups_class``), and the A/B's ablation arms,
doctor's decision rows and checks, and the compatibility sweep's columns are built from it.
"""

from __future__ import annotations

from .attention_grouping import AttentionGroupingSpeedup
from .base import Speedup
from .checkpointing import ActivationCheckpointing
from .chunked_loss import ChunkedLossSpeedup
from .compile import RegionalCompile
from .fused_kernels import FusedKernelsSpeedup
from .lora_compute import LoraInComputeDtype
from .moe_routing import SortedMoeRouting
from .packed_attention import PackedAttention
from .short_document_kernel import ShortDocumentKernel

_REGISTERED: list[Speedup] = [
    PackedAttention(),
    AttentionGroupingSpeedup(),
    ShortDocumentKernel(),
    SortedMoeRouting(),
    ChunkedLossSpeedup(),
    ActivationCheckpointing(),
    LoraInComputeDtype(),
    RegionalCompile(),
    FusedKernelsSpeedup(),
]


def registered() -> tuple[Speedup, ...]:
    """Every speedup, in the order of their options (``Speedups``' fields, the CLI's options)."""
    return tuple(_REGISTERED)


def in_stage_order() -> list[Speedup]:
    """The order ``optimize`` applies them in (packed attention first, checkpointing last)."""
    return sorted(_REGISTERED, key=lambda speedup: speedup.stage)


def register(speedup: Speedup) -> Speedup:
    """Add ``speedup``; its options must not clash with a registered one's, nor its name."""
    taken = {option.name for other in _REGISTERED for option in other.options}
    clash = [option.name for option in speedup.options if option.name in taken]
    if clash or any(other.name == speedup.name for other in _REGISTERED):
        raise ValueError(f"speedup {speedup.name!r}: its name or options {clash} are already registered")
    _REGISTERED.append(speedup)
    return speedup


def unregister(speedup: Speedup) -> None:
    _REGISTERED.remove(speedup)


def ablation_arms() -> dict[str, Speedup]:
    """``slipstream-no-<name>`` -> the speedup it leaves out, for every speedup with an ablation."""
    return {f"slipstream-no-{s.ablation_name}": s for s in _REGISTERED if s.ablation is not None}


def doctor_rows() -> list[Speedup]:
    return [speedup for speedup in _REGISTERED if speedup.doctor_label is not None]


def sweep_columns() -> list[Speedup]:
    return [speedup for speedup in _REGISTERED if speedup.sweep_column is not None]


__all__ = [
    "ablation_arms",
    "doctor_rows",
    "in_stage_order",
    "register",
    "registered",
    "sweep_columns",
    "unregister",
]
