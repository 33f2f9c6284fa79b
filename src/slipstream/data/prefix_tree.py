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

This module builds the trie, counts what it saves (:class:`TrieReport`: the tokens a layer runs with
the rows whole, with one shared start per group, and with the trie) and cuts it into trees that fit a
packed row (:func:`share_rows_as_trees`), which :func:`slipstream.packing.trees.collate_trees` packs.

A tree larger than a bin is split at its subtrees: a subtree that does not fit beside its path runs as
a tree of its own that repeats the path (its ancestors' tokens once more, counted as
``repeated_tokens``), and the others are packed best-fit into parts that each hold the path once.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from .binpack import best_fit_decreasing
from .prefix_groups import MIN_SHARED_TOKENS, SavedTokens, find_groups

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


def trie_report(rows: Sequence[dict], root: TrieNode | None = None, with_groups: bool = True) -> TrieReport:
    """Count ``rows`` whole, with today's one shared start per group (``with_groups``; else 0), and as
    a trie."""
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
    one_start = (
        sum(
            shared + sum(len(rows[i]["input_ids"]) - shared for i in members)
            for shared, members in find_groups(rows)
        )
        if with_groups
        else 0
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


def _without_short_spans(
    node: TrieNode, min_shared: int, keep: Callable[[TrieNode], bool] | None = None
) -> int:
    """Push every shared span shorter than ``min_shared`` down into its children (each holds it again):
    a few shared tokens (a role header between two turns) save less than the extra document a level
    costs. ``keep``: spans kept however short (GRPO's prompt ends: the layout it replaces shares every
    prompt). Returns the tokens this adds to the trie."""
    added = 0
    children = list(node.children)
    kept: list[TrieNode] = []
    while children:
        child = children.pop()
        if child.children and len(child.ids) < min_shared and not (keep is not None and keep(child)):
            below = [
                TrieNode(child.ids + g.ids, child.labels + g.labels, g.children, g.ends)
                for g in child.children
            ]
            if child.ends:
                below.append(TrieNode(list(child.ids), list(child.labels), [], child.ends))
            added += len(child.ids) * (len(below) - 1)
            children += below  # looked at again: joined to a short child they may still be short
        else:
            kept.append(child)
    node.children = kept[::-1]
    return added + sum(_without_short_spans(child, min_shared, keep) for child in node.children)


Tree = dict[str, Any]  # {"tree_nodes": [{"input_ids", "labels", "parent"}], "tree_rows": [end node per row]}


def _size(node: TrieNode, cache: dict[int, int]) -> int:
    """Tokens of ``node`` and everything below it (memoised by ``id``)."""
    if id(node) not in cache:
        cache[id(node)] = len(node.ids) + sum(_size(child, cache) for child in node.children)
    return cache[id(node)]


def _fit(
    node: TrieNode, path: TrieNode, max_tokens: int, sizes: dict[int, int]
) -> tuple[list[TrieNode], int]:
    """``node`` (below ``path``, its ancestors' tokens as one span) as trees of at most ``max_tokens``
    each, every tree's first node the path and ``node``'s span; and the path tokens repeated."""
    head = TrieNode(path.ids + node.ids, path.labels + node.labels, [], list(node.ends))
    if len(head.ids) + _size(node, sizes) - len(node.ids) <= max_tokens:
        head.children = list(node.children)
        return [head], 0
    room = max_tokens - len(head.ids)
    parts: list[TrieNode] = []
    repeated = 0  # beyond the trie: the path's tokens are the caller's to count, once per part
    fitting = []
    for child in node.children:
        if _size(child, sizes) > room:  # runs as trees of its own, each repeating the head
            pieces, more = _fit(child, head, max_tokens, sizes)
            parts += pieces
            repeated += more
        else:
            fitting.append(child)
    groups = best_fit_decreasing(fitting, room, size=lambda child: _size(child, sizes))
    if head.ends and not groups:
        groups = [[]]  # rows that end at the head still run, in a part of their own
    for number, children in enumerate(groups):
        parts.append(TrieNode(head.ids, head.labels, list(children), head.ends if number == 0 else []))
    # every part holds this node's span: the trie holds it once
    repeated += len(node.ids) * (len(parts) - 1)
    return parts, repeated


def _as_tree(root: TrieNode) -> Tree:
    """A trie node and what is below it as a packable tree: nodes in pre-order, a chain of single
    children with no row ending between them joined into one node. ``tree_row_numbers``: each row's
    number in the rows the trie was built from (``tree_rows``' order), for a caller that must put
    the rows' predictions back in their own order (GRPO's completions)."""
    nodes: list[dict[str, Any]] = []
    ends: list[int] = []
    numbers: list[int] = []

    def visit(node: TrieNode, parent: int) -> None:
        ids, labels = list(node.ids), list(node.labels)
        while len(node.children) == 1 and not node.ends:
            node = node.children[0]
            ids += node.ids
            labels += node.labels
        index = len(nodes)
        nodes.append({"input_ids": ids, "labels": labels, "parent": parent})
        ends.extend([index] * len(node.ends))
        numbers.extend(node.ends)
        for child in node.children:
            visit(child, index)

    visit(root, -1)
    return {"tree_nodes": nodes, "tree_rows": ends, "tree_row_numbers": numbers}


def tree_tokens(tree: Tree, shared: bool = True) -> int:
    """Tokens a tree takes in a packed row: every node once (``shared``), or its rows whole."""
    nodes = tree["tree_nodes"]
    if shared:
        return sum(len(node["input_ids"]) for node in nodes)
    total = 0
    for end in tree["tree_rows"]:
        while end >= 0:
            total += len(nodes[end]["input_ids"])
            end = nodes[end]["parent"]
    return total


@dataclass
class TreeSharingReport(SavedTokens):
    """What running one step's rows as prefix trees saves, by level, and what splitting cost."""

    rows: int = 0
    trees: int = 0  # trees of two rows or more, before they are split to fit a bin
    rows_in_trees: int = 0
    parts: int = 0  # the packed trees those became
    unshared_tokens: int = 0  # every row whole
    trie_tokens: int = 0  # the trie: every shared history once
    shared_tokens: int = 0  # the packed trees: the trie plus the paths splitting repeats
    repeated_tokens: int = 0
    short_tokens: int = 0  # shared spans shorter than MIN_SHARED_TOKENS, run once per child instead
    depth: int = 0
    saved_by_level: dict[int, int] = field(default_factory=dict)
    unit: str = "rows"  # what the trie's rows are ("pairs": preference pairs, data.pair_trees)

    def summary(self) -> str:
        if not self.trees:
            return f"prefix trees: no two of {self.rows} {self.unit} start with the same tokens"
        levels = ", ".join(
            f"level {level}: {saved:,}" for level, saved in sorted(self.saved_by_level.items())
        )
        return (
            f"prefix trees: {self.rows_in_trees} of {self.rows} {self.unit} in {self.trees} trees of depth up to "
            f"{self.depth} ({self.parts} packed parts, {self.repeated_tokens:,} path tokens repeated to fit, "
            f"{self.short_tokens:,} in spans too short to share); "
            f"{self.shared_tokens:,} tokens run instead of {self.unshared_tokens:,} ({self.saved_fraction:.1%} "
            f"saved; the trie holds {self.trie_tokens:,}); saved by level: {levels}"
        )

    def as_dict(self) -> dict[str, Any]:
        return {
            **asdict(self),
            "saved_fraction": round(self.saved_fraction, 4),
            "saved_by_level": {str(level): saved for level, saved in sorted(self.saved_by_level.items())},
        }


def tree_items(
    rows: Sequence[dict],
    max_tokens: int,
    min_shared: int = MIN_SHARED_TOKENS,
    keep: Callable[[TrieNode], bool] | None = None,
) -> tuple[list[Tree], TreeSharingReport]:
    """``rows`` (each at most ``max_tokens``) as prefix trees of at most ``max_tokens`` tokens each: one
    per first token's subtree of the trie, split where it does not fit (module docstring); a shared
    span shorter than ``min_shared`` is not shared (every row below holds it in its own node), unless
    ``keep`` says it is."""
    longest = max((len(row["input_ids"]) for row in rows), default=0)
    if longest > max_tokens:
        raise ValueError(f"a row of {longest} tokens does not fit {max_tokens}: pack rows whole first")
    root = build_trie(rows)
    counts = trie_report(rows, root, with_groups=False)
    report = TreeSharingReport(
        rows=len(rows), unshared_tokens=counts.whole, trie_tokens=counts.trie, depth=counts.depth,
        saved_by_level=counts.saved_by_level,
    )  # fmt: skip
    report.short_tokens = _without_short_spans(root, min_shared, keep)
    kept = trie_report(rows, root, with_groups=False)  # the levels as they run, short spans pushed down
    report.depth, report.saved_by_level = kept.depth, kept.saved_by_level
    sizes: dict[int, int] = {}
    below = _rows_below(root)
    items: list[Tree] = []
    for top in root.children:
        if below[id(top)] > 1:
            report.trees += 1
            report.rows_in_trees += below[id(top)]
        parts, repeated = _fit(top, TrieNode(), max_tokens, sizes)
        report.repeated_tokens += repeated
        trees = [_as_tree(part) for part in parts]
        report.parts += len(trees) if below[id(top)] > 1 else 0
        items += trees
    report.shared_tokens = sum(tree_tokens(tree) for tree in items)
    return items, report


def share_rows_as_trees(
    rows: Sequence[dict],
    max_seq_len: int,
    seed: int = 0,
    min_shared: int = MIN_SHARED_TOKENS,
    items_of: Callable[..., tuple[list[Tree], TreeSharingReport]] = tree_items,
) -> tuple[list[list[Tree]], TreeSharingReport]:
    """Rows that each fit a bin (one step's) as prefix trees (``items_of``: :func:`tree_items`, or
    pairs' :func:`.pair_trees.pair_tree_items`) packed best-fit-decreasing by their size, ties and the
    bins in a seeded order: bins of trees, fewer or shorter than the rows' own where they share histories."""
    if max_seq_len < 2:
        raise ValueError(f"max_seq_len={max_seq_len}: must be at least 2")
    items, report = items_of(rows, max_seq_len, min_shared)
    rng = random.Random(seed)
    rng.shuffle(items)  # a seeded order among equal sizes, kept by the stable sort
    bins = best_fit_decreasing(items, max_seq_len, size=tree_tokens)
    rng.shuffle(bins)
    return bins, report


def combined_tree_reports(reports: Sequence[TreeSharingReport]) -> TreeSharingReport:
    """Several steps' reports as one (counts summed, the depth the deepest)."""
    total = TreeSharingReport(unit=reports[0].unit if reports else "rows")
    for report in reports:
        for name in ("rows", "trees", "rows_in_trees", "parts", "unshared_tokens", "trie_tokens",
                     "shared_tokens", "repeated_tokens", "short_tokens"):  # fmt: skip
            setattr(total, name, getattr(total, name) + getattr(report, name))
        total.depth = max(total.depth, report.depth)
        for level, saved in report.saved_by_level.items():
            total.saved_by_level[level] = total.saved_by_level.get(level, 0) + saved
    return total
