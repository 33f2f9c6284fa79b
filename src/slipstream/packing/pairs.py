"""Preference pairs packed with their prompt once: ``prompt | chosen | rejected`` in one row.

A pair's two answers share a prompt. Run apart (what every peer does), the prompt runs twice,
once before each answer. Packed here, a pair is two documents of the row: ``prompt + chosen``
(plain causal attention) and ``rejected``, whose queries attend to the prompt at the start of
the document before it and then causally to themselves, never to the chosen answer
(``PackedBatch.prefix_lens``). Its positions continue from the prompt's end, as if it followed
the prompt alone, so RoPE (and anything else computed from position_ids) sees what it would see
with the answer run alone after its prompt.

Everything is known on the host when the pairs are collated: the documents' lengths, their
prefixes, positions and which row position predicts which answer token (``AnswerSpans``: the
rejected answer's first token is predicted from the prompt's last token, which is not the row
position before it). So, as for SFT, the attention reads Python ints and builds no [T, T] mask:
a rejected answer's [R, P + R] causal mask is the only mask, built once per shape per batch.

``prefix_sharing=False`` packs the same pair as two plain documents, ``prompt + chosen`` and
``prompt + rejected`` (the A/B's other arm: every layer runs the prompt twice).
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Sequence
from typing import Any

import torch

from ..data.binpack import best_fit_decreasing
from .batch import IGNORE_INDEX, AnswerSpans, PackedBatch, int_list
from .groups import answer_row
from .trees import collate_trees

PAIR_KEYS = ("prompt_ids", "chosen_ids", "rejected_ids")


def pair_tokens(pair: dict[str, Any], prefix_sharing: bool = True) -> int:
    """Tokens the pair takes in a packed row: P + C + R shared, 2P + C + R otherwise."""
    prompt, chosen, rejected = (len(pair[key]) for key in PAIR_KEYS)
    return prompt + chosen + rejected + (0 if prefix_sharing else prompt)


def counted_tokens(pairs: Sequence[dict[str, Any]]) -> int:
    """Tokens of pairs as every layout is counted (benchmarks, tokens/s): prompt + chosen + prompt +
    rejected, so tokens/s ratios between layouts are pairs/s ratios."""
    return sum(pair_tokens(pair, prefix_sharing=False) for pair in pairs)


def pair_documents(pairs: Sequence[dict[str, Any]]) -> list[dict[str, list[int]]]:
    """The pairs as the shared layout's documents (``input_ids`` / ``labels``), for a model-FLOP
    count or a token-id check: prompt + chosen, then the rejected answer (its attention to the
    prompt is not counted: a slight undercount of the work a pair needs)."""
    docs = []
    for pair in pairs:
        prompt, chosen, rejected = (list(pair[key]) for key in PAIR_KEYS)
        docs.append({"input_ids": prompt + chosen, "labels": [IGNORE_INDEX] * len(prompt) + chosen})
        docs.append({"input_ids": rejected, "labels": [IGNORE_INDEX, *rejected]})
    return docs


def collate_pairs(
    pairs: Sequence[dict[str, Any]],
    prefix_sharing: bool = True,
    device: torch.device | str | None = None,
    pad_id: int | None = None,
) -> PackedBatch:
    """Pack ``pairs`` (``{"prompt_ids", "chosen_ids", "rejected_ids"}``, token id lists) into one row.
    ``pad_id``: the id a reward model's config pads with (``answers.ends`` skips it, as transformers does).

    Answer ``2i`` is pair i's chosen answer, ``2i + 1`` its rejected one (``batch.answers``).
    ``labels`` mark the answer tokens (for code that counts them); the log-probs are read at
    ``answers.positions``, which is what a preference loss uses.
    """
    if not pairs:
        raise ValueError("collate_pairs needs at least one pair")
    # a pair is a prefix group of two: the prompt, then the chosen and rejected answers
    parsed = ([_ids(pair, key, number) for key in PAIR_KEYS] for number, pair in enumerate(pairs))
    row, positions, targets, lengths, ends = answer_row(
        ((prompt, [chosen, rejected]) for prompt, chosen, rejected in parsed), prefix_sharing, pad_id
    )
    answers = AnswerSpans.of(positions, targets, lengths, ends=ends)
    batch = row.batch(num_label_tokens=len(positions), loss_positions=answers.positions, answers=answers)
    return batch.to(device) if device is not None else batch


def collate_pair_trees(
    trees: Sequence[dict[str, Any]], device: torch.device | str | None = None
) -> PackedBatch:
    """Pack pair trees (:func:`slipstream.data.pair_trees.share_pairs_as_trees`) into one row: every
    shared history once, each answer attending to its prompt's whole path and causally to itself
    (:func:`.trees.collate_trees`). Answer ``2j`` / ``2j + 1`` are the chosen / rejected answers of the
    j-th pair in the trees' ``tree_pairs`` order; each answer's log-prob sum equals its
    ``collate_pairs`` one (the same predictions, each from the same context)."""
    if not trees:
        raise ValueError("collate_pair_trees needs at least one tree")
    batch = collate_trees(trees)
    # collate_trees lists each row's predictions in row order: a row is prompt path + answer, and only
    # the answer is labelled, so row r's predictions are answer r's tokens
    lengths = [len(tree["tree_nodes"][end]["input_ids"]) for tree in trees for end in tree["tree_rows"]]
    if sum(lengths) != batch.num_label_tokens:
        raise ValueError("a pair tree labels tokens outside its answers")
    answers = AnswerSpans.of(batch.loss_positions, batch.loss_targets, lengths)
    # the answers carry the targets: the SFT path of explicit targets stays off (as for collate_pairs)
    batch = dataclasses.replace(batch, answers=answers, loss_targets=None, _memo={})
    return batch.to(device) if device is not None else batch


def _ids(pair: dict[str, Any], key: str, number: int) -> list[int]:
    if key not in pair:
        raise KeyError(f"pair {number} has no {key!r}")
    ids = int_list(pair[key], f"pair {number}: {key!r}")
    if not ids:
        raise ValueError(f"pair {number}: {key!r} is empty")
    return ids


def pack_pairs(pairs: list[dict[str, Any]], max_seq_len: int, seed: int = 0) -> list[list[dict[str, Any]]]:
    """Best-fit-decreasing bins of pairs by their shared length (prompt once, both answers); ties in
    a seeded order. Every pair fits one bin (``tokenize_pair`` cut it to ``max_seq_len``)."""
    order = list(pairs)
    random.Random(seed).shuffle(order)
    return best_fit_decreasing(order, max_seq_len, size=pair_tokens)
