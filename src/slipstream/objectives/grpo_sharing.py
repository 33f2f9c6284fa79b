"""``data.share_prefixes`` on GRPO's update: a micro-batch's completions as prefix trees where they share more
than their own prompt.

Today a micro-batch packs each prompt once for its G completions (``grpo.prefix_sharing``,
:func:`slipstream.packing.completions.collate_completions`). The prompts of one micro-batch often share
with each other too (a long system prompt, an agent's tool schemas), and an agent's G trajectories of one
prompt often share their first turns (the same first tool call, the same tool result) before they branch.
As prefix trees (:func:`slipstream.packing.completions.collate_completion_trees`) every such history runs
once. Every completion token's log-prob is the same number either way (fp32; bf16 within rounding, as any
layout), so the update trains the same step.

The layout is chosen per micro-batch on the host, once its rollouts are known (they are sampled every
round, so nothing can be decided before step 0):

- ``tree`` / ``on``: trees for every micro-batch;
- ``auto``: trees where this device's cost model (:class:`.sharing.LayoutCost`, as SFT's ``auto``) finds
  them at least ``AUTO_MIN_SAVING`` faster than today's layout; without a cost model, where they run at
  least that share fewer tokens. A model that cannot take a deeper layout exactly (LongRoPE's two factor
  sets: a deeper shared path can put two rows on either side of its threshold) keeps today's layout.
- ``off``: today's layout.

Each step's record counts, hardware-independently, the tokens the update ran, what today's layout would
have run, and the micro-batches packed as trees.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..packing.completions import (
    collate_completion_trees,
    collate_completions,
    completion_documents,
    completion_tokens,
    completion_trees,
)
from .sharing import AUTO_MIN_SAVING, LayoutCost, layout_documents


@dataclass
class StepTreeCounts:
    """What one step's micro-batches ran (this rank): tokens in the layout run, in today's, trees used."""

    tokens: int = 0
    tokens_today: int = 0
    tree_micro_batches: int = 0

    def record(self) -> dict[str, Any]:
        return {
            "update_tokens": self.tokens,
            "update_tokens_today": self.tokens_today,
            "tree_micro_batches": self.tree_micro_batches,
        }


@dataclass
class CompletionTrees:
    """A run's ``data.share_prefixes`` on GRPO's update (the module docstring)."""

    mode: str  # auto, on, tree
    cost: LayoutCost | None = None  # this device's cost model (auto); None: decide by tokens
    unable: str | None = None  # why auto keeps today's layout on this model (None: it may choose)
    step: StepTreeCounts = field(default_factory=StepTreeCounts)

    @classmethod
    def make(cls, mode: str, model, cost: Callable[[], LayoutCost] | None) -> CompletionTrees | None:
        """The run's choice, or None where it is off; ``cost`` builds the cost model (``auto`` only)."""
        if mode == "off":
            return None
        unable = _cannot_deepen(model)
        return cls(mode, cost() if mode == "auto" and cost is not None and unable is None else None, unable)

    def policy(self) -> str:
        if self.mode != "auto":
            return f"prefix trees across the micro-batch's prompts and completions (data.share_prefixes: {self.mode})"
        if self.unable is not None:
            return f"one prompt per group (data.share_prefixes auto: {self.unable})"
        rule = (
            "the cost model of this device finds them"
            if self.cost is not None and (self.cost.token_seconds or self.cost.pair_seconds)
            else "they run"
        )
        return (
            "prefix trees across the micro-batch's prompts and completions where "
            f"{rule} at least {AUTO_MIN_SAVING:.0%} {'faster' if 'cost' in rule else 'fewer tokens'} than one "
            "prompt per group (data.share_prefixes: auto, decided per micro-batch)"
        )

    def pack(self, groups: Sequence[dict[str, Any]], temperature: float):
        """``groups`` (one micro-batch's) in the chosen layout: ``(CompletionBatch, its documents)``."""
        today = sum(completion_tokens(g) for g in groups)
        trees = completion_trees(groups)
        shared = sum(len(n["input_ids"]) for t in trees for n in t["tree_nodes"])
        use = self._use_trees(groups, trees, today, shared)
        self.step.tokens_today += today
        if use:
            self.step.tree_micro_batches += 1
            self.step.tokens += shared
            packed = collate_completion_trees(groups, trees, temperature=temperature)
            return packed, layout_documents(trees)
        self.step.tokens += today
        return collate_completions(groups, True, temperature=temperature), completion_documents(groups)

    def _use_trees(self, groups, trees, today: int, shared: int) -> bool:
        if self.mode != "auto":
            return True
        if self.unable is not None or shared >= today:
            return False
        cost = self.cost
        if cost is None or not (cost.token_seconds or cost.pair_seconds):
            return shared <= (1 - AUTO_MIN_SAVING) * today
        return cost.seconds([trees]) <= (1 - AUTO_MIN_SAVING) * cost.seconds([list(groups)])

    def take_step(self) -> StepTreeCounts:
        """This step's counts (and a fresh count for the next)."""
        found, self.step = self.step, StepTreeCounts()
        return found


def validate_sharing(config, fail) -> None:
    """``data.share_prefixes``' refusals for GRPO, by key (``fail(key, message)``)."""
    shares = config.data.share_prefixes
    if shares == "groups":
        fail(
            "data.share_prefixes",
            "data.share_prefixes groups is for SFT rows; grpo runs each prompt once for its completions "
            "already (grpo.prefix_sharing): set data.share_prefixes tree to share what prompts and "
            "completions share beyond that, or auto / off",
        )
    if shares in ("tree", "on") and not config.grpo.prefix_sharing:
        fail(
            "data.share_prefixes",
            f"data.share_prefixes {shares} runs every shared prompt once; grpo.prefix_sharing false runs "
            "each prompt once per completion: set one of them otherwise (data.share_prefixes off)",
        )
    if shares in ("tree", "on") and config.speedups.chunked_loss is False:
        fail(
            "data.share_prefixes",
            f"data.share_prefixes {shares} on completions reads each completion token's log-prob across the "
            "shared history (the chunked loss): set speedups.chunked_loss true (or leave it out), or "
            "data.share_prefixes off",
        )


def _cannot_deepen(model) -> str | None:
    """Why ``model`` cannot take a deeper shared layout than one prompt per group exactly (None: it can)."""
    config = getattr(model, "config", None)
    for c in (config, getattr(config, "text_config", None)):
        rope = (
            (getattr(c, "rope_scaling", None), getattr(c, "rope_parameters", None)) if c is not None else ()
        )
        if "longrope" in repr(rope):  # flat or per layer type (transformers 5's rope_parameters)
            return (
                "longrope rotates a row with the factors of its length, and a deeper shared path can put two "
                "rows that share it on either side of its threshold"
            )
    return None
