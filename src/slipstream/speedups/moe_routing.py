"""Sorted MoE routing: each MoE layer's tokens grouped by expert once (argsort + bincount) and the
experts run in one grouped pass, plugged in through transformers' experts interface; by default
on wherever the experts allow it exactly, else logged and stock."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..moe.experts import (
    COMPUTE_CHOICE,
    EXPERTS_IMPLEMENTATION,
    MoeCompute,
    MoeRouting,
    UnsupportedExperts,
    check_experts_module,
    experts_modules,
    is_moe_model,
    register_experts_implementation,
)
from ..moe.grouped import GroupedLinear
from .base import (
    AblationRun,
    ApplyContext,
    DecisionContext,
    Option,
    ParityCase,
    Speedup,
    dtype_name,
    one_line,
)


def check_sorted_routing(base: torch.nn.Module, modules: list[torch.nn.Module]) -> None:
    """Raise UnsupportedExperts unless sorted routing can run every experts module of ``base``."""
    if not is_moe_model(base):
        raise ValueError(f"moe_routing='sorted': {type(base).__name__} has no MoE layers")
    if not modules:
        raise UnsupportedExperts(
            f"{type(base).__name__} is an MoE model but its experts do not use transformers' experts "
            "interface (@use_experts_implementation); sorted routing cannot plug in. "
            "Use slipstream.optimize(model, moe_routing='stock')."
        )
    for module in modules:
        check_experts_module(module)


@dataclass
class MoeRoutingState:
    """The MoE routing a model runs: "sorted", or None (transformers' own)."""

    routing: str | None = None


class SortedMoeRouting(Speedup):
    name = "moe routing"
    stage = 20
    options = (
        Option(
            "moe_routing",
            MoeRouting | None,
            None,
            "MoE routing: sorted (argsort + counts, one grouped pass) or stock; default sorted where exact",
            stock="stock",
        ),
        Option("moe_compute", MoeCompute, "auto", "sorted-routing expert compute: auto, grouped_mm or loop"),
    )
    ablation = {"moe_routing": "stock"}
    ablation_name = "moe-routing"
    doctor_label = "MoE routing"
    sweep_column = "sorted MoE routing"
    sweep_header = "MoE"

    def apply(self, run: ApplyContext) -> None:
        base, state = run.base, run.state
        own = state.of(MoeRoutingState)
        routing, compute = run.speedups.moe_routing, run.speedups.moe_compute
        modules = experts_modules(base)
        if routing is None:  # the default: sorted where it plugs in exactly, else stock (logged)
            routing = "stock"
            if is_moe_model(base):
                try:
                    check_sorted_routing(base, modules)
                    routing = "sorted"
                except UnsupportedExperts as error:
                    state.say(f"moe routing: stock ({error})")
        if routing == "sorted":
            check_sorted_routing(base, modules)
            for module in modules:
                COMPUTE_CHOICE[module] = compute
            register_experts_implementation()
            if own.routing != "sorted":
                base.set_experts_implementation(EXPERTS_IMPLEMENTATION)
                own.routing = "sorted"
            state.say(f"moe routing: sorted ({len(modules)} experts modules, compute {compute})")
        elif own.routing is not None:
            if any(getattr(m, "slipstream_nf4", None) is not None for m in modules):
                raise ValueError("4-bit experts run only with moe_routing='sorted'")
            base.set_experts_implementation(state.stock_experts_implementation or "eager")
            own.routing = None
            state.say("moe routing: stock", log=f"moe routing: stock ({state.stock_experts_implementation})")

    def ablation_applies(self, run: AblationRun) -> bool:
        from types import SimpleNamespace

        return is_moe_model(SimpleNamespace(config=run.model_config))  # no experts: the same run twice

    def decide(self, context: DecisionContext) -> tuple[str, str]:
        model, moe_model, device, dtype = context.model, context.moe_model, context.device, context.dtype
        modules = experts_modules(moe_model)
        where = (
            "" if moe_model is model else f" (a tiny {context.moe_stand_in}: {context.family} has no experts)"
        )
        if not is_moe_model(moe_model):
            return "-", f"{context.family} has no experts"
        try:
            if not modules:
                raise UnsupportedExperts(
                    f"{type(moe_model).__name__}'s experts do not use transformers' experts interface"
                )
            for module in modules:
                check_experts_module(module)
        except UnsupportedExperts as error:
            return "stock" + where, one_line(error)
        module = modules[0]
        first = getattr(module, "gate_up_proj" if module.has_gate else "up_proj", None)
        if getattr(module, "slipstream_nf4", None) is not None or not isinstance(first, torch.Tensor):
            path, why = "loop", "4-bit experts: chunked dequantization"
        else:
            hidden = moe_model.config.get_text_config().hidden_size
            x = torch.zeros(16, hidden, dtype=dtype, device=device)
            linear = GroupedLinear(x, first.detach().to(device=device, dtype=dtype), None, None, "auto")
            path, why = linear.path, linear.reason
            if path == "grouped_mm":
                why = f"grouped_mm runs {dtype_name(dtype)} experts on {device.type} (0 host syncs)"
            else:
                why += " (the loop path: one host read of the expert counts per layer)"
        return f"sorted, {path}{where}", why

    def sweep_cell(self, policies: list[str], moe: bool, offloaded: str) -> str:
        if not moe:
            return "-"
        return "on" if any(line.startswith("moe routing: sorted") for line in policies) else "off"

    def parity_cases(self) -> tuple[ParityCase, ...]:
        return (
            ParityCase(
                "sorted MoE routing",
                fast={"moe_routing": "sorted"},
                stock={"moe_routing": "stock"},
                arms="sorted routing vs transformers' own experts",
                moe=True,
                sweep=False,  # the sweep's main arm routes sorted wherever the family has experts
            ),
        )
