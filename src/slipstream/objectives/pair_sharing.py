"""``data.share_prefixes`` on preference pairs: a step's pairs whose prompts share history run as prefix
trees (:mod:`slipstream.data.pair_trees`), every history once; the pairs each step trains never change.

The layout of a step is a function of the step's bins alone (seeded by their indices), so a step made of
the same bins in another epoch (``data.step_order: histories``: the same blocks every epoch) runs the
same trees. That is what lets the reference run in the **same layout** as the policy: a DPO loss reads
the policy's sums less the reference's, which start equal (a LoRA adapter starts at zero), so in bf16 a
reference computed in another layout (each pair packed alone) would differ from the step-0 policy by
rounding alone and move the loss off ln 2 (measured: 0.702 against 0.693 at step 0 on the real
SmolLM2-135M). ``preference.reference: precomputed`` therefore computes every distinct step layout's
reference sums before step 0 (:meth:`PairTrees.reference_items`); ``per_step`` runs them in the step, on
the step's own trees.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from ..data.steps import steps_per_epoch
from ..packing.pairs import collate_pair_trees
from .base import ObjectiveContext
from .sharing import LayoutCost, PrefixSharing

logger = logging.getLogger("slipstream")

Layout = list[tuple[list[list[dict]], list[int]]]  # this rank's [(micro-batches of trees, their bin indices)]


def layout_seed(step_bins: Sequence[int]) -> int:
    """A step's layout seed from its bins alone (a tuple of ints hashes the same in every process)."""
    return hash(tuple(step_bins)) % 1_000_003


class PairTrees:
    """A run's pair trees: the decision (:meth:`decide`), each step's layout (:meth:`layout`), and the
    step layouts whose reference sums run before step 0 (:meth:`reference_items`)."""

    def __init__(self, config: Any, reference_pass: bool = False):
        self.config = config
        self.reference_pass = reference_pass  # a precomputed reference runs each step layout before step 0
        self.sharing = PrefixSharing(
            config.data.share_prefixes, config.data.max_seq_len, config.seed, pairs=True
        )

    @property
    def on(self) -> bool:
        return self.sharing.on

    def decide(self, context: ObjectiveContext) -> str:
        """Trees across the pairs whose prompts share history, decided on the first epoch's steps (rank
        0's, every rank the same) as for SFT rows; the first tree micro-batch probed. The policy line."""
        info, config = context.ranks, self.config
        per_step = config.training.grad_accum * info.world_size
        epoch = context.epoch_steps or steps_per_epoch(len(context.bins), per_step)
        steps = [
            [context.bins[index] for index in context.step_bins(step)[:: info.world_size]]
            for step in range(min(context.steps, epoch))
        ]
        on = self.sharing.decide(
            steps, lambda: LayoutCost.of(context.base_model, context.device, context.dtype)
        )
        if on and config.data.share_prefixes == "auto" and self._reference_per_layout(context, epoch):
            # the cost model does not count the reference pass: with shuffled steps over several epochs
            # it would run once per epoch (each epoch's steps are new layouts), not once
            on = self.sharing.on = False
            self.sharing.layout = None
            self.sharing.policy = (
                "shared prefixes off (auto: the precomputed reference would run again in every epoch's "
                "new step layouts; data.step_order histories keeps the layouts, or set data.share_prefixes "
                f"tree): {self.sharing.policy.split(': ', 1)[-1]}"
            )
        if info.world_size > 1:  # rank 0's decision for every rank (its cost model was measured there)
            on = round(info.sum(float(on) if info.is_main else 0.0)) > 0
            self.sharing.on, self.sharing.layout = on, "tree" if on else None
        if self.sharing.on:
            self.sharing.probe(context, steps[0], collate_pair_trees)
        logger.info("%s", self.sharing.policy)
        return self.sharing.policy

    def _reference_per_layout(self, context: ObjectiveContext, epoch: int) -> bool:
        """Whether a precomputed reference would run more step layouts than one epoch holds (shuffled
        steps over more than one epoch: every epoch's steps are other bins together)."""
        if not self.reference_pass or context.steps <= epoch:
            return False
        return len({tuple(context.step_bins(step)) for step in range(context.steps)}) > epoch

    def layout(self, context: ObjectiveContext, step_bins: Sequence[int]) -> Layout:
        """This rank's micro-batches of trees for a step of ``step_bins`` (every rank's): its own bins'
        pairs as trees, or, where the ranks would run different counts, each bin's pairs on their own
        (every rank as many micro-batches: DDP, FSDP2)."""
        info, bins, seed = context.ranks, context.bins, layout_seed(step_bins)
        share = self.sharing.share
        ranks = [list(step_bins[rank :: info.world_size]) for rank in range(info.world_size)]
        trees = [share([bins[i] for i in mine], seed) for mine in ranks]
        if len({len(micro) for micro in trees}) > 1:
            return [(share([bins[i]], seed), [i]) for i in ranks[info.rank]]
        return [(trees[info.rank], ranks[info.rank])]

    def reference_items(
        self, context: ObjectiveContext
    ) -> tuple[list[tuple[tuple[int, ...], int]], list[list[dict]]]:
        """Every distinct step of the run (by its bins) with how many micro-batches this rank runs in it,
        and, in order, those tree micro-batches: what a reference pass in the policy's layout runs once
        before step 0."""
        steps: list[tuple[tuple[int, ...], int]] = []
        seen: set[tuple[int, ...]] = set()
        micro: list[list[dict]] = []
        for step in range(context.steps):
            key = tuple(context.step_bins(step))
            if key in seen:
                continue
            seen.add(key)
            found = [trees for parts, _ in self.layout(context, key) for trees in parts]
            steps.append((key, len(found)))
            micro += found
        return steps, micro
