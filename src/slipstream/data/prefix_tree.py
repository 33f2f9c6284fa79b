"""Rows as a token trie: every shared history once, at every level (issue 47's first piece: the count).

``data.share_prefixes`` today groups rows by one shared start (:mod:`.prefix_groups`). Multi-turn data
shares at every level: a reasoning chat of K user turns trained as K rows (Qwen3's template drops the
earlier turns' reasoning, so row k is not a prefix of row k+1) shares the history up to turn k with
row k+1 and then diverges; agent steps, preference pairs on long histories and branching rollouts do
the same. The trie holds each such history once.

A node is a span of tokens that every row below it holds, **ids and labels** alike: a span labelled
differently in two rows is not shared (a labelled token in a shared span is trained once per row
that holds it, which needs it labelled the same in all of them). The root is empty; a row's path from
the root spells the row. A row that is a prefix of another ends inside the other's path (on a node
boundary: the trie splits there).

This module builds the trie and counts what it saves (:class:`TrieReport`): the tokens a layer runs
with the rows whole, with one shared start per group, and with the trie. The packed attention over a
tree, its exact loss and its packing are not built yet: nothing in training reads this.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from .prefix_groups import find_groups

Token = tuple[int, int]  # (id, label): two rows share a token only where both agree


@dataclass
class TrieNode:
    """A span every row below holds, ``ids`` with their ``labels``; ``ends``: the rows that end here."""

    ids: list[int] = field(default_factory=list)
    labels: list[int] = field(default_factory=list)
    children: list[TrieNode] = field(default_factory=list)
    ends: list[int] = field(default_factory=list)

    def walk(self, depth: int = 0):
        """Every node below (this one first) with its depth (the root's children are at depth 1)."""
        yield self, depth
        for child in self.children:
            yield from child.walk(depth + 1)


def build_trie(rows: Sequence[dict]) -> TrieNode:
    """The trie of ``rows`` (``{"input_ids", "labels"}`` each): a compressed trie on (id, label) pairs,
    children in the order their first row comes."""
    root = TrieNode()
    for index, row in enumerate(rows):
        ids, labels = list(row["input_ids"]), list(row["labels"])
        if len(ids) != len(labels):
            raise ValueError(f"row {index}: {len(ids)} input_ids but {len(labels)} labels")
        _insert(root, list(zip(ids, labels, strict=True)), index)
    return root


def _insert(node: TrieNode, tokens: list[Token], row: int) -> None:
    while True:
        if not tokens:
            node.ends.append(row)
            return
        child = next((c for c in node.children if (c.ids[0], c.labels[0]) == tokens[0]), None)
        if child is None:
            ids, labels = zip(*tokens, strict=True)
            node.children.append(TrieNode(list(ids), list(labels), ends=[row]))
            return
        common = _common(child, tokens)
        if common < len(child.ids):  # the row parts from this span inside it: split the span there
            tail = TrieNode(child.ids[common:], child.labels[common:], child.children, child.ends)
            child.ids, child.labels = child.ids[:common], child.labels[:common]
            child.children, child.ends = [tail], []
        node, tokens = child, tokens[common:]


def _common(node: TrieNode, tokens: list[Token]) -> int:
    n = 0
    for token in zip(node.ids, node.labels, strict=True):
        if n >= len(tokens) or tokens[n] != token:
            break
        n += 1
    return n


@dataclass
class TrieReport:
    """The tokens a layer runs three ways, and what the trie's levels hold."""

    rows: int
    whole: int  # every row packed whole
    one_start: int  # today's sharing: one shared start per group of rows (prefix_groups.find_groups)
    trie: int  # every node once
    depth: int  # the deepest node's level
    tokens_by_level: dict[int, int]  # level -> tokens its nodes hold
    saved_by_level: dict[int, int]  # level -> tokens the rows would run again without sharing it

    def line(self) -> str:
        return (
            f"{self.rows} rows: {self.whole:,} tokens whole, {self.one_start:,} with one shared start a group, "
            f"{self.trie:,} as a trie of depth {self.depth} ({self.one_start / max(self.trie, 1):.2f}x fewer "
            "than one start)"
        )


def trie_report(rows: Sequence[dict], root: TrieNode | None = None) -> TrieReport:
    """Count ``rows`` whole, with today's one shared start per group, and as a trie."""
    root = root if root is not None else build_trie(rows)
    whole = sum(len(r["input_ids"]) for r in rows)
    tokens_by_level: dict[int, int] = {}
    saved_by_level: dict[int, int] = {}
    below_of = _rows_below(root)
    for node, depth in root.walk():
        if depth == 0:
            continue
        below = below_of[id(node)]
        tokens_by_level[depth] = tokens_by_level.get(depth, 0) + len(node.ids)
        saved_by_level[depth] = saved_by_level.get(depth, 0) + (below - 1) * len(node.ids)
    trie = sum(tokens_by_level.values())
    # today's one level (prefix_groups.find_groups, before its groups are split to fit bins)
    one_start = sum(
        shared + sum(len(rows[i]["input_ids"]) - shared for i in members)
        for shared, members in find_groups(rows)
    )
    depth = max((d for _, d in root.walk()), default=0)
    return TrieReport(len(rows), whole, one_start, trie, depth, tokens_by_level, saved_by_level)


def _rows_below(root: TrieNode) -> dict[int, int]:
    """How many rows end at or below each node (by ``id``), counted once bottom-up."""
    counts: dict[int, int] = {}

    def count(node: TrieNode) -> int:
        counts[id(node)] = len(node.ends) + sum(count(child) for child in node.children)
        return counts[id(node)]

    count(root)
    return counts
