"""Prefix groups: one shared prefix and N continuations in one packed row, the prefix run once.

A group is ``{"prefix_ids", "prefix_labels", "continuations": [{"input_ids", "labels"}, ...]}``:
N sequences ``prefix + continuation_j`` that share their start (a system prompt, a prompt with
several answers). Run apart, every layer computes the prefix N times. Packed here, the group is
N documents of the row: ``prefix + continuation_0`` (plain causal attention), then each other
continuation, whose queries attend to the prefix at the start of document 0 and causally to
themselves, never to a sibling (``PackedBatch.prefix_lens`` / ``prefix_sources``). Their
positions continue from the prefix's end, so RoPE sees what it sees with ``prefix +
continuation_j`` run alone.

The SFT loss is exactly the loss of the N unshared rows (``collate_packed`` of every
``prefix + continuation_j``), gradients included. ``PackedBatch.loss_positions`` /
``loss_targets`` list every prediction those rows count, at the row position that makes it
here: a continuation's first token is predicted from the prefix's last token (not the row
position before it), and a labelled token inside the prefix counts once per continuation (its
position is repeated N times). ``num_label_tokens`` is the unshared rows' label count, so
``num_items_in_batch`` does not change. The chunked loss reads those two tensors; the stock loss
(shifted labels) cannot express them, see :mod:`slipstream.loss.chunked_loss`.

A preference pair (:mod:`.pairs`) is a group of two: the prompt and its chosen / rejected answers.
Everything here is Python ints on the host; the batch is moved once, like any other.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch

from ..data.prefix_groups import group_tokens
from .batch import IGNORE_INDEX, PackedBatch, collate_packed, cumulative, int_list


class GroupRow:
    """Builds one packed row of prefix groups from Python lists (shared by groups and pairs).

    ``add_group(prefix, continuations)`` appends document ``prefix + continuations[0]`` and one
    document per further continuation that attends to that prefix; it returns, per continuation,
    the row position of each of its tokens *as the unshared row would place it* (``alone_rows``:
    prefix positions first), which is what maps an unshared row's prediction onto this row.
    """

    def __init__(self) -> None:
        self.input_ids: list[int] = []
        self.labels: list[int] = []
        self.position_ids: list[int] = []
        self.seq_lens: list[int] = []
        self.prefix_lens: list[int] = []
        self.prefix_sources: list[int] = []

    def _document(self, ids: list[int], first_position: int, prefix: int, source: int) -> int:
        start = len(self.input_ids)
        self.input_ids.extend(ids)
        self.position_ids.extend(range(first_position, first_position + len(ids)))
        self.seq_lens.append(len(ids))
        self.prefix_lens.append(prefix)
        self.prefix_sources.append(source)
        return start

    def add_group(self, prefix: list[int], continuations: Sequence[list[int]]) -> list[list[int]]:
        """Append a group; per continuation the row positions of ``prefix + continuation``."""
        P = len(prefix)
        first = len(self.seq_lens)
        start = self._document(prefix + list(continuations[0]), 0, 0, first)
        prefix_rows = list(range(start, start + P))
        alone_rows = [list(range(start, start + P + len(continuations[0])))]
        for continuation in continuations[1:]:
            if P:
                c_start = self._document(list(continuation), P, P, first)
            else:  # nothing shared: a plain document
                c_start = self._document(list(continuation), 0, 0, len(self.seq_lens))
            alone_rows.append(prefix_rows + list(range(c_start, c_start + len(continuation))))
        return alone_rows

    def batch(self, **fields: Any) -> PackedBatch:
        sharing = any(self.prefix_lens)
        sources = tuple(self.prefix_sources)
        # kept only where a document's prefix is not the previous document's (pairs keep None)
        previous = all(
            not p or s == i - 1 for i, (p, s) in enumerate(zip(self.prefix_lens, sources, strict=True))
        )
        return PackedBatch(
            input_ids=torch.tensor([self.input_ids], dtype=torch.long),
            labels=torch.tensor([self.labels], dtype=torch.long),
            position_ids=torch.tensor([self.position_ids], dtype=torch.long),
            cu_seqlens=torch.tensor(cumulative(self.seq_lens), dtype=torch.int32),
            seq_lens=tuple(self.seq_lens),
            max_seqlen=max(self.seq_lens),
            prefix_lens=tuple(self.prefix_lens) if sharing else None,
            prefix_sources=None if not sharing or previous else sources,
            **fields,
        )


def answer_row(
    groups: Iterable[tuple[list[int], list[list[int]]]], prefix_sharing: bool, pad_id: int | None = None
) -> tuple[GroupRow, list[int], list[int], list[int], list[int]]:
    """A row of ``(prompt, answers)`` groups, the answers labelled (pairs, completions): the row, and per
    answer token the row position that predicts it and the token; every answer's length, and the row
    position where a sequence classifier reads prompt + answer's score: its last token that is not
    ``pad_id``, as transformers pools it (``(index * (ids != pad)).argmax()``: position 0 where every
    token is ``pad_id``; the last token without one)."""
    row = GroupRow()
    positions, targets, lengths, ends = [], [], [], []
    for prompt, answers in groups:
        P = len(prompt)
        if prefix_sharing:
            # an answer after the first follows the prompt (positions P..), not the answer before it
            alone_rows = row.add_group(prompt, answers)
            row.labels.extend([IGNORE_INDEX] * P + [t for answer in answers for t in answer])
        else:
            alone_rows = row.add_group([], [prompt + answer for answer in answers])
            row.labels.extend(t for answer in answers for t in [IGNORE_INDEX] * P + answer)
        for answer, rows in zip(answers, alone_rows, strict=True):
            # answer token k is predicted from position P + k - 1 of prompt + answer run alone (an
            # answer after the first: its first token from the prompt's last row position when shared)
            positions.extend(rows[P - 1 : P + len(answer) - 1])
            targets.extend(answer)
            lengths.append(len(answer))
            ends.append(rows[_last_scored(prompt + answer, pad_id)])
    return row, positions, targets, lengths, ends


def _last_scored(ids: list[int], pad_id: int | None) -> int:
    """The index a sequence classifier reads ``ids`` at: the last that is not ``pad_id`` (else 0)."""
    if pad_id is None:
        return len(ids) - 1
    return next((i for i in range(len(ids) - 1, -1, -1) if ids[i] != pad_id), 0)


def collate_groups(
    groups: Sequence[dict[str, Any]],
    prefix_sharing: bool = True,
    device: torch.device | str | None = None,
) -> PackedBatch:
    """Pack prefix ``groups`` into one row for SFT (see the module docstring for a group's keys).

    ``prefix_labels`` / a continuation's ``labels`` default to -100 (prefix, not trained) / its
    ``input_ids``; -100 marks a token not trained. The loss (and every gradient) equals that of
    ``collate_packed`` over every ``prefix + continuation_j`` (:func:`unshared_documents`), which
    is what ``prefix_sharing=False`` returns (the A/B's other arm).
    """
    if not groups:
        raise ValueError("collate_groups needs at least one group")
    parsed = [_parse(group, number) for number, group in enumerate(groups)]
    if not prefix_sharing:
        return collate_packed(unshared_documents(groups), device=device)
    row = GroupRow()
    positions: list[int] = []
    targets: list[int] = []
    for prefix, prefix_labels, continuations in parsed:
        alone_rows = row.add_group(prefix, [ids for ids, _ in continuations])
        # ``labels``: each token's label as its unshared row has it (that row's first one -100)
        row.labels.extend([IGNORE_INDEX, *prefix_labels[1:]] if prefix else [])
        for (_, labels), rows in zip(continuations, alone_rows, strict=True):
            # the unshared row prefix + continuation_j as collate_packed counts it: its first label
            # dropped, position t predicting label t + 1
            alone_labels = prefix_labels + labels
            for t in range(len(alone_labels) - 1):
                if alone_labels[t + 1] != IGNORE_INDEX:
                    positions.append(rows[t])
                    targets.append(alone_labels[t + 1])
            row.labels.extend(labels if prefix else [IGNORE_INDEX, *labels[1:]])
    batch = row.batch(
        num_label_tokens=len(positions),
        loss_positions=torch.tensor(positions, dtype=torch.long),
        # nothing shared (every group one continuation, or no prefix): the shifted labels say it all,
        # and the batch is collate_packed's, which the stock loss computes too
        loss_targets=torch.tensor(targets, dtype=torch.long) if any(row.prefix_lens) else None,
    )
    return batch.to(device) if device is not None else batch


def unshared_documents(groups: Sequence[dict[str, Any]]) -> list[dict[str, list[int]]]:
    """Every ``prefix + continuation_j`` as a plain document (``input_ids`` / ``labels``): the
    rows a group's loss must equal, and ``collate_groups(..., prefix_sharing=False)``'s documents."""
    docs = []
    for number, group in enumerate(groups):
        prefix, prefix_labels, continuations = _parse(group, number)
        for ids, labels in continuations:
            docs.append({"input_ids": prefix + ids, "labels": prefix_labels + labels})
    return docs


def counted_tokens(groups: Sequence[dict[str, Any]]) -> int:
    """Tokens of groups as every layout counts them (benchmarks, tokens/s): sum(P + C_j) per group,
    the unshared rows' tokens, so tokens/s ratios between layouts are groups/s ratios."""
    return sum(group_tokens(group, prefix_sharing=False) for group in groups)


def group_documents(groups: Sequence[dict[str, Any]]) -> list[dict[str, list[int]]]:
    """The groups as the shared layout's documents (``input_ids`` / ``labels``), for a model-FLOP
    count: prefix + continuation 0, then every other continuation (its attention to the prefix is
    not counted: a slight undercount of the work a group needs)."""
    docs = []
    for number, group in enumerate(groups):
        prefix, prefix_labels, continuations = _parse(group, number)
        (ids, labels), *rest = continuations
        docs.append({"input_ids": prefix + ids, "labels": prefix_labels + labels})
        docs += [{"input_ids": ids, "labels": labels} for ids, labels in rest]
    return docs


def _parse(
    group: dict[str, Any], number: int
) -> tuple[list[int], list[int], list[tuple[list[int], list[int]]]]:
    """(prefix ids, prefix labels, [(ids, labels) per continuation]), checked."""
    if "continuations" not in group or not group["continuations"]:
        raise ValueError(f"group {number} has no continuations")
    prefix = int_list(group.get("prefix_ids", []), f"group {number}: 'prefix_ids'")
    prefix_labels = group.get("prefix_labels")
    prefix_labels = (
        [IGNORE_INDEX] * len(prefix)
        if prefix_labels is None
        else int_list(prefix_labels, f"group {number}: 'prefix_labels'")
    )
    if len(prefix_labels) != len(prefix):
        raise ValueError(f"group {number}: {len(prefix_labels)} prefix_labels for {len(prefix)} prefix_ids")
    continuations = []
    for j, continuation in enumerate(group["continuations"]):
        where = f"group {number}, continuation {j}"
        if "input_ids" not in continuation:
            raise KeyError(f"{where} has no 'input_ids'")
        ids = int_list(continuation["input_ids"], f"{where}: 'input_ids'")
        if not ids:
            raise ValueError(f"{where} is empty")
        labels = continuation.get("labels")
        labels = list(ids) if labels is None else int_list(labels, f"{where}: 'labels'")
        if len(labels) != len(ids):
            raise ValueError(f"{where}: {len(labels)} labels for {len(ids)} input_ids")
        continuations.append((ids, labels))
    return prefix, prefix_labels, continuations
