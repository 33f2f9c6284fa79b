"""KTO rows binned with their KL completions, and packed as pairs: ``prompt | completion | kl_completion``.

TRL's ``KTOTrainer`` estimates its KL baseline from mismatched completions: within each batch of
``per_device_train_batch_size`` rows it rotates the completions by +1, so row i's KL sequence is its
own prompt followed by row i-1's completion (row 0 takes the last row's). Here a bin is a micro-batch,
so the rotation is made when the bins are built (:func:`with_kl_completions`, the same rule on the
bin's rows in order): it is fixed before step 0, so the reference pass runs once over it.

A row with its KL completion is a pair in layout (chosen = the completion, rejected = the KL
completion): :func:`slipstream.packing.pairs.collate_pairs` packs it with the prompt once, the KL
completion attending to the prompt and not to the completion, its positions restarting after the
prompt (``prefix_sharing=False``: ``prompt + completion`` and ``prompt + kl_completion``, TRL's two
sequences). Rotating within a bin keeps the bin's completion tokens, so a bin takes
``sum(P + 2C)`` tokens whatever the rotation: the bins are filled by that size.
``apo_zero_unpaired`` needs no KL sequence: a row is then ``prompt | completion``.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

import torch

from ..data.binpack import best_fit_decreasing
from .batch import IGNORE_INDEX, AnswerSpans, PackedBatch
from .groups import answer_row
from .pairs import collate_pairs, pair_documents


def kto_tokens(row: dict[str, Any], kl: bool = True) -> int:
    """Tokens the row takes in a bin: its prompt, its completion and (``kl``) a completion's worth for
    its KL sequence (a bin's KL completions are its completions, rotated)."""
    return len(row["prompt_ids"]) + len(row["completion_ids"]) * (2 if kl else 1)


def with_kl_completions(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The bin's rows as pairs for :func:`collate_pairs`: ``chosen_ids`` the row's completion,
    ``rejected_ids`` the KL completion (TRL's rotation: row i takes row i-1's, row 0 the last row's)."""
    completions = [row["completion_ids"] for row in rows]
    rotated = [completions[-1], *completions[:-1]]
    return [
        {**row, "chosen_ids": row["completion_ids"], "rejected_ids": kl}
        for row, kl in zip(rows, rotated, strict=True)
    ]


def without_kl_completions(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The bin's rows for ``apo_zero_unpaired`` (no KL sequence): ``rejected_ids`` empty."""
    return [{**row, "chosen_ids": row["completion_ids"], "rejected_ids": []} for row in rows]


def pack_kto(
    rows: list[dict[str, Any]], max_seq_len: int, seed: int = 0, kl: bool = True
) -> list[list[dict]]:
    """Best-fit-decreasing bins of rows by :func:`kto_tokens` (ties in a seeded order), each bin's rows
    then given their KL completions (``kl``) or none. With ``kl``, a bin left with one row (best-fit
    leaves one at the end) takes a row from a bin of three or more where it fits
    (:func:`no_single_rows`)."""
    order = list(rows)
    random.Random(seed).shuffle(order)
    bins = best_fit_decreasing(order, max_seq_len, size=lambda row: kto_tokens(row, kl))
    if kl:
        bins = no_single_rows(bins, max_seq_len, size=kto_tokens)
    return [with_kl_completions(rows) if kl else without_kl_completions(rows) for rows in bins]


def no_single_rows(bins: list[list[dict]], max_seq_len: int, size) -> list[list[dict]]:
    """``bins`` with each one-row bin given the smallest row that fits it from a bin of three or more
    rows (the biggest such bin first), so that every KL completion is another row's; a one-row bin no
    row can join is left (the objective refuses it, naming the fix)."""
    bins = [list(rows) for rows in bins]
    for alone in (rows for rows in bins if len(rows) == 1):
        room = max_seq_len - size(alone[0])
        donors = sorted((rows for rows in bins if len(rows) >= 3), key=len, reverse=True)
        for donor in donors:
            fitting = [row for row in donor if size(row) <= room]
            if fitting:
                moved = min(fitting, key=size)
                donor.remove(moved)
                alone.append(moved)
                break
    return bins


def collate_kto(rows: Sequence[dict[str, Any]], prefix_sharing: bool = True, device=None) -> PackedBatch:
    """One micro-batch of binned rows: with KL completions, :func:`collate_pairs` (answer ``2i`` row
    i's completion, ``2i + 1`` its KL completion); without, ``prompt | completion`` per row (answer i)."""
    if rows and rows[0]["rejected_ids"]:
        return collate_pairs(rows, prefix_sharing, device)
    row, positions, targets, lengths, _ = answer_row(
        ((list(r["prompt_ids"]), [list(r["completion_ids"])]) for r in rows), prefix_sharing
    )
    answers = AnswerSpans.of(positions, targets, lengths)
    batch = row.batch(num_label_tokens=len(positions), loss_positions=answers.positions, answers=answers)
    return batch.to(device) if device is not None else batch


def kto_documents(rows: Sequence[dict[str, Any]]) -> list[dict[str, list[int]]]:
    """The rows as the packed row's documents: as pairs with KL completions, else prompt + completion."""
    if rows and rows[0]["rejected_ids"]:
        return pair_documents(rows)
    return [
        {
            "input_ids": [*row["prompt_ids"], *row["completion_ids"]],
            "labels": [IGNORE_INDEX] * len(row["prompt_ids"]) + list(row["completion_ids"]),
        }
        for row in rows
    ]


def kto_counted_tokens(rows: Sequence[dict[str, Any]]) -> int:
    """Tokens as TRL runs them (tokens/s in every layout): prompt + completion, and prompt + KL completion."""
    return sum(
        len(r["prompt_ids"])
        + len(r["completion_ids"])
        + (len(r["prompt_ids"]) + len(r["rejected_ids"])) * bool(r["rejected_ids"])
        for r in rows
    )


def labels_of(rows: Sequence[dict[str, Any]], device=None) -> torch.Tensor:
    """[rows] bool: which rows' completions are desirable."""
    labels = torch.tensor([bool(row["label"]) for row in rows], dtype=torch.bool)
    return labels.to(device) if device is not None else labels
