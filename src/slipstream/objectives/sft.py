"""``training.objective: sft``: next-token loss on packed documents, every label token weighing the same.

Rows are SFT samples (``data.load_samples``, or the built-in demo rows), packed best-fit
decreasing into bins; a micro-batch is a ``PackedBatch``'s model inputs and its label-token
count. Each micro-batch's summed loss is divided by the label tokens of the whole step
(``num_items_in_batch``), so the step's loss is that of one big batch. Nothing runs before
step 0; the eval loss is the token-weighted loss of the held-out samples (:mod:`.evaluation`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch
from tqdm import tqdm

from ..data import demo_samples, load_samples, pack_samples
from ..data.labels import count_label_tokens
from ..data.steps import history_steps, steps_per_epoch
from ..errors import TrainError
from ..packing import collate_packed
from ..packing.groups import collate_groups
from ..packing.trees import collate_trees, is_tree
from .base import (
    Objective,
    ObjectiveContext,
    ObjectiveData,
    StepPlan,
    register_objective,
    split_held_out,
    tokenizer_refusals,
)
from .evaluation import EvalSet, eval_set, evaluate, split_rows
from .sharing import LAYOUTS, LayoutCost, PrefixSharing, item_tokens, layout_documents, whole_rows

logger = logging.getLogger("slipstream")


@register_objective
class SFT(Objective):
    name = "sft"
    reads = "samples"
    metrics = ("loss",)

    @classmethod
    def validate(cls, config, fail) -> None:
        if config.data.share_prefixes in ("on", "groups", "tree"):
            mode = config.data.share_prefixes
            if config.speedups.packed_attention is False:
                fail(
                    "data.share_prefixes",
                    f"data.share_prefixes {mode} needs the packed attention (a row's own tokens attend to a start "
                    "another row holds): set speedups.packed_attention true, or data.share_prefixes off",
                )
            if config.speedups.chunked_loss is False:
                fail(
                    "data.share_prefixes",
                    f"data.share_prefixes {mode} needs the chunked loss (it reads a row's first target across the "
                    "shared start): set speedups.chunked_loss true (or leave it out), or data.share_prefixes off",
                )

    # ------------------------------------------------------------------ rows and bins
    def samples(self, tokenizer, path: str | None = None):
        """The samples of the training data (``path`` None), or of another file read the same way."""
        config, data = self.config, self.config.data
        if path is None and data.path is None:
            return demo_samples(
                tokenizer, num_rows=data.demo_rows, seed=config.seed, response_only=data.response_only
            ), None
        on_bad_row = "skip" if data.skip_bad_rows else "error"

        def load(path: str):
            return load_samples(
                path, tokenizer, response_only=data.response_only, on_bad_row=on_bad_row, cache=data.cache
            )

        path = data.path if path is None else path
        samples, report = tokenizer_refusals(config, load)(path)
        if not samples:
            raise TrainError(f"{path}: no usable rows ({report.summary()})")
        return samples, report

    def _eval_set(self, samples: list[dict], source: str) -> EvalSet:
        data = self.config.data
        return eval_set(
            samples, source, max_seq_len=data.max_seq_len, seed=self.config.seed, overflow=data.overflow
        )

    def read(self, tokenizer, info) -> ObjectiveData:
        """Samples and their bins, and the eval set; the rows skipped and the samples cut are always said."""
        config = self.config
        samples, data_report = self.samples(tokenizer)
        samples, evals = split_held_out(
            config,
            info,
            samples,
            load=lambda path: self.samples(tokenizer, path),
            split=split_rows,
            eval_set=self._eval_set,
            what="data",
            said=lambda eval_report: eval_report.skipped,
        )
        bins, packing, blocks = self._bins(samples, info)
        check_labels_left(packing.no_labels, config)
        if not bins:
            raise TrainError(
                f"{config.data.path or 'the demo data'}: no sample left to train on ({packing.summary()})"
            )
        if info.is_main and data_report is not None and (data_report.skipped or data_report.cached):
            tqdm.write(f"slipstream train: {data_report.summary()}")  # skipped rows are always said
        if info.is_main and (packing.no_labels or packing.truncated):
            tqdm.write(f"slipstream train: {packing.summary()}")
        logger.info("%s", packing.summary())
        if evals is not None:
            logger.info("eval set: %s", evals.summary())
        return ObjectiveData(samples, bins, packing, data_report, evals, blocks)

    def _bins(self, samples: list[dict], info) -> tuple[list[list[dict]], Any, list[list[int]] | None]:
        """Bins of whole rows, whatever ``data.share_prefixes`` says: they fix which rows each step
        trains (``data.steps``); sharing regroups a step's rows later (:meth:`plan_step`). With
        ``data.step_order: histories`` also each step's bins (rows sharing a history together)."""
        data = self.config.data
        bins, packing = pack_samples(
            samples, data.max_seq_len, seed=self.config.seed, overflow=data.overflow, strategy=data.batching
        )
        if data.step_order == "shuffled":
            return bins, packing, None
        per_step = self.config.training.grad_accum * info.world_size
        bins, blocks = history_steps([row for rows in bins for row in rows], data.max_seq_len, per_step)
        packing.num_bins, packing.capacity = len(bins), len(bins) * data.max_seq_len
        packing.efficiency = packing.real_tokens / packing.capacity if packing.capacity else 0.0
        logger.info(
            "data.step_order histories: %d steps an epoch, rows that share a history together", len(blocks)
        )
        return bins, packing, blocks

    def before_training(self, context: ObjectiveContext) -> str | None:
        """``data.share_prefixes``' decision on the first epoch's steps (rank 0's, every rank the same):
        ``auto`` by the device's cost model. Returns its policy line."""
        config = self.config
        info = context.ranks
        self.sharing = PrefixSharing(
            config.data.share_prefixes, config.data.max_seq_len, config.seed, unable=_cannot_share(config)
        )
        if config.data.share_prefixes == "off":
            return None
        per_step = config.training.grad_accum * info.world_size
        epoch = context.epoch_steps or steps_per_epoch(len(context.bins), per_step)
        first_epoch = min(context.steps, epoch)
        steps = [
            [context.bins[index] for index in context.step_bins(step)[:: info.world_size]]
            for step in range(first_epoch)
        ]
        on = self.sharing.decide(
            steps, lambda: LayoutCost.of(context.base_model, context.device, context.dtype)
        )
        if info.world_size > 1:  # rank 0's decision for every rank (its cost model was measured there)
            layouts = (None, *LAYOUTS)
            code = layouts.index(self.sharing.layout if on else None)
            chosen = layouts[round(info.sum(float(code) if info.is_main else 0.0))]
            self.sharing.on, self.sharing.layout = chosen is not None, chosen
        if self.sharing.on:
            self.sharing.probe(
                context,
                steps[0],
                lambda micro: collate_trees(micro) if is_tree(micro[0]) else collate_groups(micro),
            )
        logger.info("%s", self.sharing.policy)
        return self.sharing.policy

    def plan_step(self, context: ObjectiveContext, step: int, step_bins) -> StepPlan:
        """The step's bins as they are, or, where sharing is on, its rows regrouped: each rank's rows
        (the bins it would have trained) in micro-batches that hold each shared start once."""
        sharing = getattr(self, "sharing", None)
        if sharing is None or not sharing.on:
            return super().plan_step(context, step, step_bins)
        info = context.ranks
        ranks = [
            sharing.share([context.bins[i] for i in step_bins[rank :: info.world_size]], step)
            for rank in range(info.world_size)
        ]
        if len({len(micro) for micro in ranks}) > 1:  # every rank runs as many micro-batches (DDP)
            ranks = [
                [sharing.share([context.bins[i]], step)[0] for i in step_bins[rank :: info.world_size]]
                for rank in range(info.world_size)
            ]
        return StepPlan(
            micro=[self.collate(groups, context.device) for groups in ranks[info.rank]],
            total=sum(context.weights[index] for index in step_bins),
            tokens=sum(self.tokens(context.bins[index]) for index in step_bins),
            documents=[self.documents(micro) for rank_micro in ranks for micro in rank_micro],
            record={"micro_batches": len(ranks[info.rank])},
        )

    def summary(self, bins, last) -> dict:
        """``data.share_prefixes``' decision, and what sharing each step's rows saves."""
        sharing = getattr(self, "sharing", None) or PrefixSharing("off", 0, 0)  # none before before_training
        return {"shared_prefixes": sharing.as_dict()}

    def weight(self, rows: Sequence[dict]) -> int:
        return count_label_tokens(whole_rows(rows))

    def documents(self, rows: Sequence[dict]) -> list[dict]:
        """A bin's documents as its packed row runs them (a group: its start once; a tree: every node once)."""
        return layout_documents(rows)

    def tokens(self, rows: Sequence[dict]) -> int:
        """The tokens of a bin's rows, every row whole: tokens/s with or without sharing counts the same."""
        return item_tokens(rows)

    # ------------------------------------------------------------------ the step
    def collate(self, rows, device, prepared: Any = None):
        if rows and is_tree(rows[0]):
            batch = collate_trees(rows, device=device)
        elif rows and "continuations" in rows[0]:  # prefix groups
            batch = collate_groups(rows, device=device)
        else:
            batch = collate_packed(rows, device=device)
        return batch.model_inputs(), batch.num_label_tokens

    def micro_weight(self, micro) -> int:
        return micro[1]

    def model_device(self, micro) -> torch.device:
        return micro[0]["input_ids"].device

    def step_weight(self, total: int, device: torch.device) -> torch.Tensor:
        return torch.tensor(total, dtype=torch.float32).to(device)  # moved once per step

    def micro_batch(self, model, micro, weight):
        inputs, _ = micro
        if "num_items_in_batch" not in inputs:
            inputs = {**inputs, "num_items_in_batch": weight}
        loss = model(**inputs).loss
        return loss, loss.detach().float().reshape(1)

    def evaluate(self, model, evals, info, device) -> dict[str, float]:
        return {"loss": evaluate(model, evals, info, device)}


def check_labels_left(no_labels: int, config) -> None:
    """Samples that ``data.max_seq_len`` leaves with no label: refused, or skipped if bad rows are."""
    if no_labels and not config.data.skip_bad_rows:
        raise TrainError(
            f"data.max_seq_len {config.data.max_seq_len}: {no_labels} sample(s) would keep no label after "
            f"being cut to it (their prompts are longer); raise data.max_seq_len, or set "
            "data.skip_bad_rows to leave them out"
        )


def _cannot_share(config) -> str | None:
    """Why this run's model path cannot honour prefix groups, or None."""
    if config.speedups.packed_attention is False:
        return "speedups.packed_attention is off"
    if config.speedups.chunked_loss is False:
        return "speedups.chunked_loss is off"
    return None
