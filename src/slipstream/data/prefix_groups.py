"""Rows that start with the same tokens, grouped so the shared start runs once (``data.share_prefixes``).

A fine-tuning set often repeats a long start in every row: an agent's system prompt and tool
schemas (1-10k tokens before a few hundred of conversation), a prompt with several accepted
answers, a conversation expanded turn by turn. Packed as they are, every layer runs that start
once per row, forward and backward. Grouped, one bin holds the start once and then each row's
remainder, which attends to the start and to itself, never to its siblings
(:func:`slipstream.packing.groups.collate_groups`), so the loss and every gradient are those of
the rows packed apart.

The sharing is found on the tokens, not on the JSON: two rows share exactly the tokens (and the
labels) they begin with, whatever template rendered them, so a template that renders a shared
system prompt differently in two rows (a date, a tool list in another order) simply shares less.
Labels must agree too: a labelled token in the shared part is trained once per row that holds
it, which needs it labelled the same in all of them.

How groups are formed, in one pass over the rows sorted by their tokens (rows that share a start
are neighbours there; the start a run of neighbours shares is the smallest of their neighbours'
common prefixes):

- a row joins the group before it when the shared start stays at least ``MIN_SHARED_TOKENS``
  long and the group saves no fewer tokens with it than without: ``n`` rows sharing ``P`` tokens
  save ``(n - 1) * P``, so a row that would shrink the shared start from ``P`` to ``P'`` joins
  only if ``n * P' >= (n - 1) * P``. (Four answers to one prompt stay a group of four rather than
  join every row that merely shares a one-line system prompt; a 2k-token system prompt before
  short conversations makes one group of every row.) One level of sharing: a group has one
  shared start, not a tree of them.
- every row keeps at least one token of its own (a row that is all shared start keeps its last).
- a group longer than a bin is split into parts that fit (the continuations best-fit into what
  the shared start leaves of a bin), each part holding the start once.
- the parts are packed into bins best-fit-decreasing by their shared length, like samples.

Which rows a step trains never depends on this (``data.steps``): the rows are packed whole, a step
takes its bins, and only then are that step's rows grouped (:func:`share_rows`) into micro-batches,
fewer or shorter ones where rows share a start. So a run with sharing takes the same optimizer
steps on the same rows as one without: the speedup changes how a step runs, never what it trains.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .binpack import Sample, best_fit_decreasing

# A shared start shorter than this is not worth a group: a chat template's role header
# (``<|im_start|>user\n``) is 3-4 tokens; the shortest system prompts are tens.
MIN_SHARED_TOKENS = 16

Group = dict[str, Any]  # {"prefix_ids", "prefix_labels", "continuations": [{"input_ids", "labels"}, ...]}


class SavedTokens:
    """What a sharing report saves: its ``unshared_tokens`` (every row whole) less its ``shared_tokens``."""

    unshared_tokens: int
    shared_tokens: int

    @property
    def saved_tokens(self) -> int:
        return self.unshared_tokens - self.shared_tokens

    @property
    def saved_fraction(self) -> float:
        return self.saved_tokens / self.unshared_tokens if self.unshared_tokens else 0.0


@dataclass
class SharingReport(SavedTokens):
    """What sharing the rows' common starts saves: the tokens a model runs, before and after."""

    rows: int = 0
    groups: int = 0  # groups of two or more rows (before splitting to fit a bin)
    rows_in_groups: int = 0
    parts: int = 0  # what the groups became once split to fit bins (each holds its start once)
    unshared_tokens: int = 0  # the rows' tokens, every row whole
    shared_tokens: int = 0  # the tokens the packed bins hold
    longest_shared: int = 0  # the longest shared start, in tokens

    def summary(self) -> str:
        if not self.groups:
            return (
                f"shared prefixes: no two of {self.rows} rows start with the same {MIN_SHARED_TOKENS}+ tokens"
            )
        return (
            f"shared prefixes: {self.rows_in_groups} of {self.rows} rows in {self.groups} groups "
            f"({self.parts} packed parts, longest shared start {self.longest_shared} tokens); "
            f"{self.shared_tokens} tokens run instead of {self.unshared_tokens} "
            f"({self.saved_fraction:.1%} saved)"
        )

    def as_dict(self) -> dict[str, Any]:
        return {
            "rows": self.rows,
            "groups": self.groups,
            "rows_in_groups": self.rows_in_groups,
            "parts": self.parts,
            "unshared_tokens": self.unshared_tokens,
            "shared_tokens": self.shared_tokens,
            "saved_fraction": round(self.saved_fraction, 4),
            "longest_shared": self.longest_shared,
        }


def common_prefix(a: Sample, b: Sample) -> int:
    """How many leading tokens ``a`` and ``b`` share, ids and labels both (bisection on C-level slices)."""
    lo, hi = 0, min(len(a["input_ids"]), len(b["input_ids"]))
    ids_a, ids_b, labels_a, labels_b = a["input_ids"], b["input_ids"], a["labels"], b["labels"]
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if ids_a[:mid] == ids_b[:mid] and labels_a[:mid] == labels_b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def find_groups(
    samples: Sequence[Sample], min_shared: int = MIN_SHARED_TOKENS
) -> list[tuple[int, list[int]]]:
    """``[(shared_length, [row indices])]``: the rows grouped by the start they share (see the module
    docstring); a row that shares nothing is a group of one with shared length 0."""
    order = sorted(range(len(samples)), key=lambda i: list(samples[i]["input_ids"]))
    groups: list[tuple[int, list[int]]] = []
    members: list[int] = []
    shared = 0
    for index in order:
        if members:
            own_room = min(len(samples[index]["input_ids"]), len(samples[members[-1]]["input_ids"])) - 1
            candidate = min(common_prefix(samples[members[-1]], samples[index]), own_room)
            if len(members) > 1:
                candidate = min(candidate, shared)
            n = len(members)
            if candidate >= min_shared and n * candidate >= (n - 1) * shared:
                members.append(index)
                shared = candidate
                continue
            groups.append((shared if len(members) > 1 else 0, members))
        members, shared = [index], 0
    if members:
        groups.append((shared if len(members) > 1 else 0, members))
    return groups


def _split_to_fit(shared: int, rows: list[Sample], max_seq_len: int) -> list[list[Sample]]:
    """The rows of one group in parts of at most ``max_seq_len`` tokens, each holding the start once:
    the continuations best-fit-decreasing into the room the start leaves."""
    return best_fit_decreasing(rows, max_seq_len - shared, size=lambda row: len(row["input_ids"]) - shared)


def as_group(shared: int, rows: Sequence[Sample]) -> Group:
    """One packed group: the shared start once, then every row's own tokens."""
    first = rows[0]
    return {
        "prefix_ids": list(first["input_ids"][:shared]),
        "prefix_labels": list(first["labels"][:shared]),
        "continuations": [
            {"input_ids": list(row["input_ids"][shared:]), "labels": list(row["labels"][shared:])}
            for row in rows
        ],
    }


def group_tokens(group: Group, prefix_sharing: bool = True) -> int:
    """Tokens the group takes in a packed row: P + sum(C_j) shared, sum(P + C_j) otherwise."""
    prefix = len(group.get("prefix_ids", ()))
    continuations = [len(c["input_ids"]) for c in group["continuations"]]
    return sum(continuations) + prefix * (1 if prefix_sharing else len(continuations))


def group_rows(group: Group) -> list[Sample]:
    """The group's rows as they would be packed without sharing (start + continuation, each whole)."""
    prefix_ids, prefix_labels = group["prefix_ids"], group["prefix_labels"]
    return [
        {"input_ids": prefix_ids + c["input_ids"], "labels": prefix_labels + c["labels"]}
        for c in group["continuations"]
    ]


def share_rows(
    rows: Sequence[Sample], max_seq_len: int, seed: int = 0, min_shared: int = MIN_SHARED_TOKENS
) -> tuple[list[list[Group]], SharingReport]:
    """Rows that each fit a bin (one step's), grouped by their shared start and packed best-fit by the
    shared length: bins of groups, fewer or shorter than the rows' own where they share."""
    if max_seq_len < 2:
        raise ValueError(f"max_seq_len={max_seq_len}: must be at least 2")
    items: list[Group] = []
    sharing = SharingReport(rows=len(rows), unshared_tokens=sum(len(row["input_ids"]) for row in rows))
    for shared, members in find_groups(rows, min_shared):
        members_rows = [rows[i] for i in members]
        if len(members_rows) > 1:
            sharing.groups += 1
            sharing.rows_in_groups += len(members_rows)
            sharing.longest_shared = max(sharing.longest_shared, shared)
            parts = _split_to_fit(shared, members_rows, max_seq_len)
            sharing.parts += len(parts)
            items += [as_group(shared if len(part) > 1 else 0, part) for part in parts]
        else:
            items.append(as_group(0, members_rows))
    rng = random.Random(seed)
    rng.shuffle(items)  # a seeded order among equal sizes, kept by the stable sort
    bins = best_fit_decreasing(items, max_seq_len, size=group_tokens)
    rng.shuffle(bins)
    sharing.shared_tokens = sum(group_tokens(item) for item in items)
    return bins, sharing


def combined(reports: Sequence[SharingReport]) -> SharingReport:
    """Several steps' reports as one (every count summed, the longest start the longest)."""
    total = SharingReport()
    for report in reports:
        for name in ("rows", "groups", "rows_in_groups", "parts", "unshared_tokens", "shared_tokens"):
            setattr(total, name, getattr(total, name) + getattr(report, name))
        total.longest_shared = max(total.longest_shared, report.longest_shared)
    return total


def unshared_tokens(items: Sequence[Sample | Group]) -> int:
    """The tokens of the rows in ``items`` (documents or groups) counted whole, every row its start
    included: what tokens/s counts in every layout, so tokens/s ratios are rows/s ratios."""
    return sum(
        group_tokens(item, prefix_sharing=False) if "continuations" in item else len(item["input_ids"])
        for item in items
    )
