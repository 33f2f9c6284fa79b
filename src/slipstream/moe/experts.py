"""Sorted MoE routing, plugged into transformers' experts-implementation registry.

``slipstream_sorted`` replaces the experts' forward for any experts class decorated with
transformers' ``@use_experts_implementation`` (Qwen3-MoE, GPT-OSS, and the others that
share the interface): group the (token, expert) pairs once (``routing.group_by_expert``),
run each projection per expert on its contiguous slice (``grouped.GroupedLinear``), then
weight, restore token order and sum over k. The router, its weights and the auxiliary
load-balancing loss are the model's own and untouched.

Per-family quirks stay in the experts class itself: layout (``is_transposed``), biases
(``has_bias``) and the gate (``_apply_gate``: GPT-OSS's clamped SwiGLU with its interleaved
gate/up columns, or the default ``act(gate) * up``).
"""

from __future__ import annotations

import logging
import weakref
from typing import Literal

import torch

from ..refusal import Refusal, optimize_call
from ..utilisation.flops import EXPERT_COUNT_KEYS, experts_modules  # noqa: F401  (experts_modules: re-exported)
from .grouped import GroupedLinear
from .routing import combine_top_k, group_by_expert, tokens_in_expert_order

logger = logging.getLogger("slipstream")

EXPERTS_IMPLEMENTATION = "slipstream_sorted"
# The routing and compute choices, defined once (Speedups and the CLIs read them).
MoeRouting = Literal["sorted", "stock"]
MoeCompute = Literal["auto", "grouped_mm", "loop"]


class UnsupportedExperts(Refusal, NotImplementedError):
    """An experts module slipstream's sorted routing cannot run exactly."""

    avoid = {"moe_routing": "stock"}


# The way out the messages name, generated from the class's ``avoid`` (text and data cannot drift).
STOCK_ROUTING = optimize_call(UnsupportedExperts.avoid)  # slipstream.optimize(model, moe_routing='stock')


def check_experts_module(module: torch.nn.Module) -> None:
    """Raise UnsupportedExperts unless ``module`` has the interface sorted routing relies on."""
    name = type(module).__name__
    if not hasattr(module, "has_gate") or not hasattr(module, "is_transposed"):
        raise UnsupportedExperts(
            f"{name} does not use transformers' @use_experts_implementation interface; sorted routing "
            f"cannot plug into it. Use {STOCK_ROUTING}.",
            refused=f"sorted routing for {name}, outside transformers' experts interface",
        )
    if getattr(module, "has_post_expert_norm", False):
        raise UnsupportedExperts(
            f"{name} applies a post-expert norm, which sorted routing does not implement. "
            f"Use {STOCK_ROUTING}.",
            refused=f"{name}'s post-expert norm under sorted routing",
        )
    if getattr(module, "_is_expert_parallel", False):
        raise UnsupportedExperts(
            f"{name} is expert-parallel; sorted routing runs all experts locally. Use {STOCK_ROUTING}.",
            refused=f"sorted routing for the expert-parallel {name}",
        )
    first = "gate_up_proj" if module.has_gate else "up_proj"
    quantized = getattr(module, "slipstream_nf4", None) is not None
    for weight in (first, "down_proj"):
        if not quantized and not isinstance(getattr(module, weight, None), torch.Tensor):
            raise UnsupportedExperts(
                f"{name} has no 3D weight {weight!r}. Use {STOCK_ROUTING}.",
                refused=f"sorted routing for {name} without a 3D {weight!r}",
            )
    if not hasattr(module, "num_experts"):
        raise UnsupportedExperts(
            f"{name} does not say how many experts it has (num_experts). Use {STOCK_ROUTING}.",
            refused=f"sorted routing for {name} without num_experts",
        )


def _weight(module, name: str):
    """(dense weight or None, 4-bit store or None) of one projection."""
    nf4 = getattr(module, "slipstream_nf4", None)
    if nf4 is not None and name in nf4.stores:
        return None, nf4.stores[name]
    return getattr(module, name), None


def _project(module, linear: GroupedLinear, x_S, name: str, groups) -> torch.Tensor:
    weight, store = _weight(module, name)
    bias = getattr(module, f"{name}_bias", None) if module.has_bias else None
    out = linear(x_S, weight, bias, module.is_transposed, store=store, expert_ids_S=groups.expert_ids_S)
    lora = getattr(module, "slipstream_lora", None)
    if lora is not None and name in lora.adapters:
        out = out + lora.adapters[name](linear, x_S, module.is_transposed, groups)
    return out


# Per experts-module settings, kept beside the modules rather than as attributes on them
# (weak keys: a module that goes away takes its entry with it).
COMPUTE_CHOICE: weakref.WeakKeyDictionary[torch.nn.Module, str] = weakref.WeakKeyDictionary()
_LOGGED_PATH: weakref.WeakKeyDictionary[torch.nn.Module, str] = weakref.WeakKeyDictionary()


def sorted_experts_forward(
    self: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """Experts forward with pairs grouped by expert once. hidden [T, H] -> [T, H]."""
    groups = group_by_expert(top_k_index, self.num_experts)
    x_SH = tokens_in_expert_order(hidden_states, groups)
    first = "gate_up_proj" if self.has_gate else "up_proj"
    first_weight, _ = _weight(self, first)
    compute = COMPUTE_CHOICE.get(self, "auto")
    linear = GroupedLinear(x_SH, first_weight, groups.counts_E, groups.offsets_E, compute)
    if _LOGGED_PATH.get(self) != linear.path:  # each choice logged once per layer
        _LOGGED_PATH[self] = linear.path
        logger.info("moe compute for %s: %s (%s)", type(self).__name__, linear.path, linear.reason)
    proj = _project(self, linear, x_SH, first, groups)
    proj = self._apply_gate(proj) if self.has_gate else self.act_fn(proj)
    out_SH = _project(self, linear, proj, "down_proj", groups)
    return combine_top_k(out_SH, top_k_weights, groups).to(hidden_states.dtype)


def register_experts_implementation() -> None:
    """Register ``slipstream_sorted`` with transformers (idempotent)."""
    from transformers.integrations.moe import ExpertsInterface

    ExpertsInterface.register(EXPERTS_IMPLEMENTATION, sorted_experts_forward)


def use_sorted_experts(model: torch.nn.Module) -> None:
    """Switch ``model``'s experts to sorted routing (``optimize`` records it as its choice too)."""
    register_experts_implementation()
    if getattr(model.config, "_experts_implementation", None) != EXPERTS_IMPLEMENTATION:
        model.set_experts_implementation(EXPERTS_IMPLEMENTATION)


# Sub-configs some families declare their experts in (DBRX: ``config.ffn_config.moe_num_experts``).
MOE_SUB_CONFIGS = ("ffn_config", "moe_config", "text_config")


def is_moe_model(model: torch.nn.Module) -> bool:
    """Does the config (or an ffn / moe / text sub-config) describe routed experts?"""
    configs = [model.config] + [getattr(model.config, key, None) for key in MOE_SUB_CONFIGS]
    return any(
        isinstance(getattr(config, key, None), int) and getattr(config, key) > 1
        for config in configs
        if config is not None
        for key in EXPERT_COUNT_KEYS
    )
