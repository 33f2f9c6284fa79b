"""Packed sequences: metadata built once per batch on the host, attention with no syncs and no T x T mask."""

from .attention import (
    BACKENDS,
    AttentionBackendUnavailable,
    UnsupportedAttentionFeature,
    register_attention_functions,
)
from .batch import IGNORE_INDEX, PACKED_BATCH_KWARG, PackedBatch, collate_packed, collate_padded
from .collator import PackedCollator, PackedInputs
from .groups import collate_groups

__all__ = [
    "BACKENDS",
    "AttentionBackendUnavailable",
    "IGNORE_INDEX",
    "PACKED_BATCH_KWARG",
    "PackedBatch",
    "PackedCollator",
    "PackedInputs",
    "UnsupportedAttentionFeature",
    "collate_groups",
    "collate_packed",
    "collate_padded",
    "register_attention_functions",
]
