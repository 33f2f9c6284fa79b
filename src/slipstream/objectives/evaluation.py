"""Validation, the objectives' held-out sets: SFT's eval set (a second data file, or a seeded share of
the training rows) and its loss, and each rank's share of any held-out bins (:func:`rank_share`).

``data.eval_path`` is read and tokenized like the training data (the same ``response_only``,
``max_seq_len``, ``overflow`` and tokenized cache); ``data.eval_fraction`` takes a seeded share
of the training rows out of training. The split is by row (one row is one sample before
packing; a long row's ``overflow: split`` pieces are cut after the split, so they all stay on
its side), never overlaps, and depends only on ``seed`` and the rows. Both sets are then packed
with best-fit-decreasing bins, as training is.

The eval loss is the token-weighted mean over every label token of the eval set (the labels
training uses: response-only when training is), computed under ``torch.no_grad()`` with the
model in eval mode (each module's mode is restored after) through the chunked loss
(``loss.chunked_evaluation``): no ``[tokens, vocab]`` logits. Under torchrun each rank takes
every ``world_size``-th bin, the per-rank sums are added on the device and read once; a rank
with fewer bins runs a bin again at weight zero, so every rank runs the same number of
forwards (FSDP2 gathers parameters in each).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..data import pack_samples
from ..data.errors import DataError
from ..data.labels import count_label_tokens
from ..data.prompts import split_prompts
from ..errors import TrainError
from ..host_reads import read_to_host
from ..loss import chunked_evaluation
from ..modes import eval_mode
from ..packing import collate_packed
from .base import Ranks


@dataclass
class EvalSet:
    """The packed eval set and what ``run.json`` says of it."""

    bins: list[list[dict]]
    source: str  # the file, or "eval_fraction 0.1 of <the training data>"
    rows: int
    tokens: int  # after truncation, as evaluated
    label_tokens: int

    def summary(self) -> dict:
        return {name: getattr(self, name) for name in ("source", "rows", "tokens", "label_tokens")}


@dataclass
class HeldOut:
    """Held-out rows in bins (GRPO's prompts in bins of ``prompts_per_batch``; the preference pairs,
    packed as training packs its own) and what ``run.json`` says of them, counted as ``unit``."""

    bins: list[list[dict]]
    source: str
    rows: int
    unit: str  # "prompts", "pairs"

    def summary(self) -> dict:
        return {"source": self.source, self.unit: self.rows}


def split_rows(samples: list[dict], fraction: float, seed: int, source: str) -> tuple[list[dict], list[dict]]:
    """``(train, eval)``: a seeded ``fraction`` of the rows for evaluation, the rest, in order, for training
    (the split GRPO's prompts and the pairs take; too few rows a TrainError, as SFT's set-up says it)."""
    try:
        return split_prompts(samples, fraction, seed, source, noun="rows")
    except DataError as error:
        raise TrainError(str(error)) from None


def eval_set(samples: list[dict], source: str, *, max_seq_len: int, seed: int, overflow: str) -> EvalSet:
    """Pack the eval samples as training packs its own; an eval set without a label token is an error."""
    bins, packing = pack_samples(samples, max_seq_len, seed=seed, overflow=overflow)
    label_tokens = sum(count_label_tokens(b) for b in bins)
    if not label_tokens:
        raise TrainError(
            f"{source}: no usable eval row (no label token left to evaluate; {packing.summary()})"
        )
    tokens = sum(len(sample["input_ids"]) for b in bins for sample in b)
    return EvalSet(bins=bins, source=source, rows=len(samples), tokens=tokens, label_tokens=label_tokens)


def rank_share(num_bins: int, rank: int, world_size: int) -> list[tuple[int, bool]]:
    """``(bin index, counts)`` for this rank: every ``world_size``-th bin, padded (not counted) to an
    equal number of forwards on every rank."""
    indices = [rank + j * world_size for j in range(-(-num_bins // world_size))]
    return [(index, True) if index < num_bins else (index % num_bins, False) for index in indices]


def evaluate(model: torch.nn.Module, evals: EvalSet, info: Ranks, device: torch.device) -> float:
    """The token-weighted eval loss of ``model`` over every rank's share (one host read)."""
    total = torch.zeros((), dtype=torch.float32, device=device)
    with eval_mode(model), torch.no_grad(), chunked_evaluation(model):
        for index, counts in rank_share(len(evals.bins), info.rank, info.world_size):
            batch = collate_packed(evals.bins[index], device=device)
            # each bin's loss over the whole set's label tokens: the sum is the token-weighted mean
            out = model(**batch.model_inputs(num_items_in_batch=evals.label_tokens))
            if counts:
                total += out.loss.float()
    return float(read_to_host(info.sum_tensor(total)))
