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
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .batch import IGNORE_INDEX, AnswerSpans, PackedBatch
from .groups import answer_row


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
    row, positions, targets, owner, lengths = answer_row(parsed, prefix_sharing)
    count = len(positions)
    answers = AnswerSpans(
        positions=torch.tensor(positions, dtype=torch.long),
        targets=torch.tensor(targets, dtype=torch.long),
        index=torch.arange(count, dtype=torch.long),  # every token its own answer: [tokens] log-probs
        lengths=(1,) * count,
        token_counts=torch.ones(count, dtype=torch.float32),
        temperature=float(temperature),
    )
    batch = row.batch(num_label_tokens=count, loss_positions=answers.positions, answers=answers)
    found = CompletionBatch(batch, torch.tensor(owner, dtype=torch.long), tuple(lengths))
    return found.to(device) if device is not None else found


def _parsed(group: dict[str, Any], number: int) -> tuple[list[int], list[list[int]]]:
    prompt = [int(t) for t in group["prompt_ids"]]
    completions = [[int(t) for t in c] for c in group["completions"]]
    if not prompt:
        raise ValueError(f"group {number}: the prompt is empty")
    if not completions or any(not c for c in completions):
        raise ValueError(f"group {number}: every completion needs at least one token")
    return prompt, completions
