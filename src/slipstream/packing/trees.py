"""Prefix trees in one packed row: every shared history runs once, at every level, with the loss of the
rows packed whole.

A tree (:func:`slipstream.data.prefix_tree.tree_items`) is ``{"tree_nodes": [{"input_ids", "labels",
"parent"}, ...], "tree_rows": [node, ...]}``: its nodes in depth-first pre-order (``parent``: the index
of the node it continues, -1 for the first), and per row the node it ends at; a row is the tokens of
the nodes from the first down to its end node. Every node is one document of the packed row, whose
queries attend to its ancestors' tokens (root first, whole) and causally to its own, never to a sibling
or a cousin (``PackedBatch.parents``). Its positions continue from its parent's end, so RoPE (and a
sliding window) sees what it sees in any row through it, run alone.

The loss is exactly that of the rows packed whole (``collate_packed`` of :func:`unshared_tree_rows`), gradients
included: ``loss_positions`` / ``loss_targets`` list every prediction those rows count at the row
position that makes it here. A labelled token in a shared node counts once per row that holds it (its
position repeated), and a node's first token is predicted from its parent's last one.
``num_label_tokens`` is the whole rows' label count, so ``num_items_in_batch`` does not change.

Everything here is Python ints on the host; the batch is moved once, like any other.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .batch import IGNORE_INDEX, PackedBatch, cumulative

Tree = dict[str, Any]  # {"tree_nodes": [{"input_ids", "labels", "parent"}], "tree_rows": [end node per row]}


def is_tree(item: dict[str, Any]) -> bool:
    return "tree_nodes" in item


def collate_trees(trees: Sequence[Tree], device: torch.device | str | None = None) -> PackedBatch:
    """Pack prefix ``trees`` into one row (see the module docstring); the loss and every gradient equal
    ``collate_packed(unshared_tree_rows(trees))``'s."""
    if not trees:
        raise ValueError("collate_trees needs at least one tree")
    input_ids: list[int] = []
    labels: list[int] = []
    position_ids: list[int] = []
    seq_lens: list[int] = []
    parents: list[int] = []
    positions: list[int] = []
    targets: list[int] = []
    for number, tree in enumerate(trees):
        nodes = _nodes(tree, number)
        offset = len(seq_lens)
        starts: list[int] = []  # each node's first row position
        first_position: list[int] = []  # each node's first position as its rows number it
        for ids, node_labels, parent in nodes:
            starts.append(len(input_ids))
            first = 0 if parent < 0 else first_position[parent] + len(nodes[parent][0])
            first_position.append(first)
            input_ids += ids
            # a row's first label is dropped (nothing predicts it), as collate_packed drops it
            labels += [IGNORE_INDEX, *node_labels[1:]] if parent < 0 else node_labels
            position_ids += range(first, first + len(ids))
            seq_lens.append(len(ids))
            parents.append(-1 if parent < 0 else offset + parent)
        for end in tree["tree_rows"]:
            if not 0 <= end < len(nodes):
                raise ValueError(f"tree {number}: a row ends at node {end}, which it does not have")
            rows, row_labels = [], []  # the row's tokens: where each sits here, and its label
            for index in _path(nodes, end):
                rows += range(starts[index], starts[index] + len(nodes[index][0]))
                row_labels += nodes[index][1]
            # collate_packed of the whole row: position t predicts label t + 1, its first label dropped
            for t in range(len(row_labels) - 1):
                if row_labels[t + 1] != IGNORE_INDEX:
                    positions.append(rows[t])
                    targets.append(row_labels[t + 1])
    batch = PackedBatch(
        input_ids=torch.tensor([input_ids], dtype=torch.long),
        labels=torch.tensor([labels], dtype=torch.long),
        position_ids=torch.tensor([position_ids], dtype=torch.long),
        cu_seqlens=torch.tensor(cumulative(seq_lens), dtype=torch.int32),
        seq_lens=tuple(seq_lens),
        max_seqlen=max(seq_lens),
        num_label_tokens=len(positions),
        loss_positions=torch.tensor(positions, dtype=torch.long),
        loss_targets=torch.tensor(targets, dtype=torch.long),
        parents=tuple(parents),
    )
    batch.subtree_ends()  # checks the pre-order here, not in the first layer
    return batch.to(device) if device is not None else batch


def unshared_tree_rows(trees: Sequence[Tree]) -> list[dict[str, list[int]]]:
    """Every row of ``trees`` whole (``input_ids`` / ``labels``): what a tree's loss must equal."""
    rows = []
    for number, tree in enumerate(trees):
        nodes = _nodes(tree, number)
        for end in tree["tree_rows"]:
            path = _path(nodes, end)
            rows.append(
                {
                    "input_ids": [t for i in path for t in nodes[i][0]],
                    "labels": [t for i in path for t in nodes[i][1]],
                }
            )
    return rows


def _path(nodes: list[tuple[list[int], list[int], int]], end: int) -> list[int]:
    """The node indices from the tree's first node down to ``end``."""
    path = [end]
    while nodes[path[-1]][2] >= 0:
        path.append(nodes[path[-1]][2])
    return path[::-1]


def _nodes(tree: Tree, number: int) -> list[tuple[list[int], list[int], int]]:
    """``[(ids, labels, parent)]`` of a tree, checked: a parent comes before its child, the first node
    has none, every node holds a token."""
    if not tree.get("tree_nodes") or not tree.get("tree_rows"):
        raise ValueError(f"tree {number} needs 'tree_nodes' and 'tree_rows', both non-empty")
    nodes = []
    for index, node in enumerate(tree["tree_nodes"]):
        ids, labels, parent = list(node["input_ids"]), list(node["labels"]), int(node["parent"])
        if not ids or len(ids) != len(labels):
            raise ValueError(f"tree {number}, node {index}: {len(ids)} input_ids and {len(labels)} labels")
        if (index == 0) != (parent < 0) or parent >= index:
            raise ValueError(
                f"tree {number}, node {index}: parent {parent} (only node 0 has none; a parent comes first)"
            )
        nodes.append((ids, labels, parent))
    return nodes
