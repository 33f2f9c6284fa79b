"""MoE: sorted routing (argsort + counts once per layer), grouped expert compute, 4-bit experts, expert LoRA."""

from .experts import EXPERTS_IMPLEMENTATION, UnsupportedExperts, experts_modules, sorted_experts_forward
from .routing import ExpertGroups, group_by_expert

__all__ = [
    "EXPERTS_IMPLEMENTATION",
    "ExpertGroups",
    "UnsupportedExperts",
    "experts_modules",
    "group_by_expert",
    "sorted_experts_forward",
]
