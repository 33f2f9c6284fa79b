"""G sampled completions of a prompt packed as one prefix group, every completion token's log-prob read.

Online RL (GRPO) updates the policy on the completions it sampled: ``prompt | completion_1 | ... |
completion_G`` is a prefix group (:mod:`.groups`), the prompt run once, each completion attending
to the prompt and to itself, its positions continuing from the prompt's end. The loss needs the
log-prob of every completion token on its own (a per-token importance ratio and clip), so the
batch's ``answers`` (:class:`AnswerSpans`) make each completion token an answer of its own
(``index`` = 0, 1, 2, ...): the chunked head returns ``[tokens]`` log-probs without building
``[tokens, vocab]`` logits, and its backward scales each row by that token's own weight.
``completion_index`` says which completion each token belongs to.

``prefix_sharing=False`` packs ``prompt + completion_j`` as G plain documents (the A/B's other
arm: every layer runs the prompt G times); the log-probs are the same numbers.

:func:`collate_completion_trees` packs a micro-batch's groups as prefix trees instead
(:mod:`.trees`): the trie of every ``prompt + completion_j`` row of the micro-batch, so what prompts
share with *each other* (a system prompt, tool schemas, an agent's earlier turns) and what completions
share (the same first tool call and its result, identical completions) runs once too. Each token's
log-prob is read at the row position that predicts it in that trie, every completion's tokens listed
again in completion order, so the batch's ``[tokens]`` log-probs line up with ``completion_index``
exactly as :func:`collate_completions`' do (a shared completion token is read once per completion that
holds it: its loss terms differ by their advantages).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..data.prefix_groups import MIN_SHARED_TOKENS
from ..data.prefix_tree import Tree, TrieNode, tree_items
from .batch import IGNORE_INDEX, AnswerSpans, PackedBatch, owners
from .groups import answer_row
from .trees import collate_trees


@dataclass
class CompletionBatch:
    """A packed row of completion groups and, per completion token, which completion it is."""

    batch: PackedBatch
    completion_index: torch.Tensor  # [tokens] long: the completion (0..C-1, groups in order) of each token
    lengths: tuple[int, ...]  # tokens of every completion, host ints

    @property
    def num_completions(self) -> int:
        return len(self.lengths)

    def to(self, device: torch.device | str) -> CompletionBatch:
        return CompletionBatch(self.batch.to(device), self.completion_index.to(device), self.lengths)


def completion_tokens(group: dict[str, Any], prefix_sharing: bool = True) -> int:
    """Tokens the group takes in a packed row: P + sum(C_j) shared, sum(P + C_j) otherwise."""
    prompt, completions = len(group["prompt_ids"]), [len(c) for c in group["completions"]]
    return sum(completions) + prompt * (1 if prefix_sharing else len(completions))


def completion_documents(groups: Sequence[dict[str, Any]], prefix_sharing: bool = True) -> list[dict]:
    """The groups as the documents their packed row holds (model FLOPs, token-id checks): prompt +
    completion 0, then each other completion (shared), or every prompt + completion (unshared)."""
    docs = []
    for group in groups:
        prompt = list(group["prompt_ids"])
        for number, completion in enumerate(group["completions"]):
            ids = (prompt if number == 0 or not prefix_sharing else []) + list(completion)
            docs.append(
                {"input_ids": ids, "labels": [IGNORE_INDEX] * (len(ids) - len(completion)) + list(completion)}
            )
    return docs


def collate_completions(
    groups: Sequence[dict[str, Any]],
    prefix_sharing: bool = True,
    device: torch.device | str | None = None,
    temperature: float = 1.0,
) -> CompletionBatch:
    """Pack ``groups`` (``{"prompt_ids", "completions": [ids, ...]}``) into one row; every completion
    token's log-prob is read at the row position that predicts it (``batch.answers``), with the
    logits divided by ``temperature`` (the distribution the completions were sampled from)."""
    if not groups:
        raise ValueError("collate_completions needs at least one group")
    parsed = (_parsed(group, number) for number, group in enumerate(groups))
    row, positions, targets, lengths, _ = answer_row(parsed, prefix_sharing)
    count = len(positions)
    # every token its own answer: [tokens] log-probs
    answers = AnswerSpans.of(positions, targets, [1] * count, temperature)
    batch = row.batch(num_label_tokens=count, loss_positions=answers.positions, answers=answers)
    found = CompletionBatch(batch, owners(lengths), tuple(lengths))
    return found.to(device) if device is not None else found


def completion_rows(groups: Sequence[dict[str, Any]]) -> list[dict[str, list[int]]]:
    """Every ``prompt + completion_j`` of ``groups`` as a row, the completion labelled with its own ids
    (a tool result's tokens too: which count is the loss mask's business, not the layout's); in order."""
    rows = []
    for number, group in enumerate(groups):
        prompt, completions = _parsed(group, number)
        for completion in completions:
            rows.append(
                {"input_ids": prompt + completion, "labels": [IGNORE_INDEX] * len(prompt) + completion}
            )
    return rows


def completion_trees(groups: Sequence[dict[str, Any]], min_shared: int = MIN_SHARED_TOKENS) -> list[Tree]:
    """A micro-batch's groups as prefix trees (one packed row: never split), a shared span shorter
    than ``min_shared`` run once per row instead, except where a prompt ends (every prompt runs once
    for its completions, as today, however short); each tree's ``tree_row_numbers`` say which
    completion (groups in order) each of its rows is."""
    rows = completion_rows(groups)
    items, _ = tree_items(rows, sum(len(r["input_ids"]) for r in rows), min_shared, keep=_prompt_end)
    return items


def _prompt_end(node: TrieNode) -> bool:
    """A span that ends where a prompt does and a completion starts: kept shared however short, so the
    trees never run a prompt more often than :func:`collate_completions` does."""
    return node.labels[-1] == IGNORE_INDEX and any(c.labels[0] != IGNORE_INDEX for c in node.children)


def collate_completion_trees(
    groups: Sequence[dict[str, Any]],
    trees: Sequence[Tree] | None = None,
    device: torch.device | str | None = None,
    temperature: float = 1.0,
) -> CompletionBatch:
    """Pack ``groups`` as prefix trees (``trees``: :func:`completion_trees` of them, built when None)
    into one row; token ``k`` of the batch's answers is the same completion token as in
    :func:`collate_completions` (the module docstring), its log-prob the same number."""
    if not groups:
        raise ValueError("collate_completion_trees needs at least one group")
    lengths = [len(c) for group in groups for c in group["completions"]]
    trees = completion_trees(groups) if trees is None else trees
    batch = collate_trees(trees)
    # collate_trees lists each row's predictions in its tree's row order; a row's labelled tokens are its
    # completion's, so row r's predictions are completion r's tokens, predicted in order
    blocks: dict[int, tuple[int, int]] = {}
    start = 0
    for tree in trees:
        for number in tree["tree_row_numbers"]:
            if not 0 <= number < len(lengths) or number in blocks:
                raise ValueError(f"completion trees: row {number} is not one of the groups' completions")
            blocks[number] = (start, start + lengths[number])
            start += lengths[number]
    if start != batch.num_label_tokens or sorted(blocks) != list(range(len(lengths))):
        raise ValueError("completion trees: the trees' rows are not the groups' completions")
    order = [index for number in range(len(lengths)) for index in range(*blocks[number])]
    pick = torch.tensor(order, dtype=torch.long)
    positions, targets = batch.loss_positions.index_select(0, pick), batch.loss_targets.index_select(0, pick)
    # every token its own answer: [tokens] log-probs
    answers = AnswerSpans.of(positions, targets, [1] * len(order), temperature)
    # the answers carry the targets: the SFT path of explicit targets stays off (as for completion groups)
    batch = dataclasses.replace(
        batch, answers=answers, loss_positions=answers.positions, loss_targets=None, _memo={}
    )
    found = CompletionBatch(batch, owners(lengths), tuple(lengths))
    return found.to(device) if device is not None else found


def _parsed(group: dict[str, Any], number: int) -> tuple[list[int], list[list[int]]]:
    prompt = [int(t) for t in group["prompt_ids"]]
    completions = [[int(t) for t in c] for c in group["completions"]]
    if not prompt:
        raise ValueError(f"group {number}: the prompt is empty")
    if not completions or any(not c for c in completions):
        raise ValueError(f"group {number}: every completion needs at least one token")
    return prompt, completions
