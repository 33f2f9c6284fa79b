"""Attention grouping: on the per-document SDPA path, documents of similar length share one
batched, right-padded call instead of one call each; ``auto`` weighs calls, padded score FLOPs
and the gather with cost figures measured on this CPU (``packing.calibration``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..packing import calibration
from ..packing.costs import ATTENTION_COSTS, BUILTIN, AttentionCosts
from ..packing.grouping import (
    GROUPING_CHOICE,
    GROUPING_COUNTS,
    AttentionGrouping,
    GroupingCounts,
    grouping_policy,
)
from .base import ApplyContext, DecisionContext, Option, ParityCase, Speedup
from .packed_attention import has_attention_sinks


@dataclass
class AttentionGroupingState:
    """The packed SDPA path's grouping on a model (``state.of(AttentionGroupingState)``): the choice
    running (None while the packed attention is off), the cost figures its and the short-document
    kernel's ``auto`` weigh (measured on a CPU, else built in), and the batches and calls that ran
    grouped / per document (``packing.grouping``)."""

    choice: str | None = None
    costs: AttentionCosts = BUILTIN
    counts: GroupingCounts = field(default_factory=GroupingCounts)


def attention_costs(run: ApplyContext):
    """What the packed SDPA path's ``auto`` choices weigh: the figures measured on this CPU, dtype
    and thread count (once, cached) where an ``auto`` needs them, else the built-in ones; installed
    on the model's modules once per ``optimize`` call."""
    if "attention_costs" not in run.facts:
        speedups, device = run.speedups, run.device
        costs = BUILTIN
        auto = "auto" in (speedups.attention_grouping, speedups.short_document_kernel)
        if run.facts.get("attention_backend") == "sdpa" and device.type == "cpu" and auto:
            costs = calibration.attention_costs(device, run.dtype)
        for module in run.base.modules():  # whichever module the model passes to the attention
            ATTENTION_COSTS[module] = costs
        run.state.of(AttentionGroupingState).costs = costs
        run.facts["attention_costs"] = costs
    return run.facts["attention_costs"]


def choose_on_modules(run: ApplyContext, own, wanted: str, table: dict):
    """A packed-SDPA choice (``own.choice``) put in ``table`` for every module: the cost
    figures it weighs, or None where nothing changes (the packed attention is off: chosen afresh
    when it is back; or ``wanted`` already runs)."""
    if run.facts.get("attention_backend") is None:
        own.choice = None
        return None
    if own.choice == wanted:
        return None
    costs = attention_costs(run)
    for module in run.base.modules():
        table[module] = wanted
    own.choice = wanted
    return costs


class AttentionGroupingSpeedup(Speedup):
    name = "packed attention grouping"
    stage = 11
    options = (
        Option(
            "attention_grouping",
            AttentionGrouping,
            "auto",
            "per-document SDPA path: documents of similar length share one batched call, right-padded "
            "(grouped), or one call each (per_document); auto: grouped where a cost model measured on a "
            "CPU (calls, padded score FLOPs, the gather) says it is cheaper",
        ),
    )
    ablation = {"attention_grouping": "per_document"}
    ablation_name = "attention-grouping"
    doctor_label = "attention grouping"

    def apply(self, run: ApplyContext) -> None:
        wanted, own = run.speedups.attention_grouping, run.state.of(AttentionGroupingState)
        costs = choose_on_modules(run, own, wanted, GROUPING_CHOICE)
        if costs is None:
            return
        for module in run.base.modules():
            GROUPING_COUNTS[module] = own.counts
        backend = run.facts["attention_backend"]
        line = grouping_policy(wanted, backend, has_attention_sinks(run.base), costs)
        run.state.say(f"packed attention grouping: {line}")

    def decide(self, context: DecisionContext) -> tuple[str, str]:
        from ..packing.attention import choose_backend

        sinks = has_attention_sinks(context.model)
        backend, _ = choose_backend("auto", context.device, sinks, context.dtype)
        return "auto", grouping_policy("auto", backend, sinks, context.costs).removeprefix("auto ")

    def parity_cases(self) -> tuple[ParityCase, ...]:
        return (
            ParityCase(  # on the packed row even where per-document packed attention is WRONG
                "grouped attention",
                fast={"attention_grouping": "grouped"},
                stock={"packed_attention": False},
                arms="documents grouped by length, one batched SDPA per group, vs each document alone (stock)",
                packed_only=True,
                stock_layout="alone",
                header="grouped",
            ),
        )
