"""Preference pairs whose prompts share history, as prefix trees: every shared history runs once.

A pair already runs its prompt once (``prompt | chosen | rejected``, :mod:`slipstream.packing.pairs`).
Pairs cut from one conversation (a preference at every assistant turn), several pairs on one long
prompt, or pairs under one agent's system prompt and tool schemas also share their prompts with
*each other*, at several levels: pair k+1's prompt is pair k's history plus a turn. Here a step's pairs
become the trie of their prompts (:mod:`.prefix_tree`), each pair's two answers children of the node
where its prompt ends; both answers attend to the prompt's whole path and causally to themselves,
never to each other or to another pair's tokens.

A pair is never split: the trie is built over each prompt followed by a span standing for its two
answers (``C + R`` tokens of a negative id no real token has, so no other row shares it), so the trie's
sizes, its splitting to fit a bin (a subtree that does not fit beside its path runs on its own,
repeating the path) and its packing all count the answers, and a pair's answers always land in the
tree that holds its prompt's end. The answers are not shared with anything (a chosen answer that a
later prompt repeats runs twice: once as that prompt's history, once as the answer scored).

A tree here is a :mod:`.prefix_tree` tree (nodes in pre-order, prompt nodes unlabelled, answer nodes
labelled with their own ids) whose rows are the answers, chosen then rejected for each pair, and whose
``tree_pairs`` are the pairs' numbers in the list given, so a micro-batch's answer ``2j`` / ``2j + 1``
are pair ``tree_pairs[j]``'s.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .labels import IGNORE_INDEX
from .prefix_groups import MIN_SHARED_TOKENS
from .prefix_tree import Tree, TreeSharingReport, share_rows_as_trees, tree_items


def pair_tree_items(
    pairs: Sequence[dict[str, Any]], max_tokens: int, min_shared: int = MIN_SHARED_TOKENS
) -> tuple[list[Tree], TreeSharingReport]:
    """``pairs`` (``prompt_ids`` / ``chosen_ids`` / ``rejected_ids``, each pair at most ``max_tokens``
    with its prompt once) as prefix trees of at most ``max_tokens`` tokens (module docstring). The
    report counts today's layout (each pair's prompt once) as the unshared tokens."""
    rows = []
    for number, pair in enumerate(pairs):
        prompt = list(pair["prompt_ids"])
        answers = len(pair["chosen_ids"]) + len(pair["rejected_ids"])
        placeholder = [-(number + 1)] * answers  # the pair's answers: tokens no other row holds
        rows.append({"input_ids": prompt + placeholder, "labels": [IGNORE_INDEX] * (len(prompt) + answers)})
    items, report = tree_items(rows, max_tokens, min_shared)
    report.unit = "pairs"
    return [_with_answers(item, pairs) for item in items], report


def _with_answers(item: Tree, pairs: Sequence[dict[str, Any]]) -> Tree:
    """A tree of prompts with placeholders as a tree of prompts with each pair's two answer nodes."""
    nodes = item["tree_nodes"]
    children: list[list[int]] = [[] for _ in nodes]
    for index, node in enumerate(nodes):
        if node["parent"] >= 0:
            children[node["parent"]].append(index)
    attached: dict[int, list[int]] = {}  # node -> the pairs whose answers follow it
    kept_ids: list[list[int]] = []
    for index, node in enumerate(nodes):
        ids = list(node["input_ids"])
        own = next((i for i, token in enumerate(ids) if token < 0), len(ids))
        kept_ids.append(ids[:own])
        if own < len(ids):  # the node a row ends at: the placeholder is its last span
            if item["tree_rows"].count(index) != 1 or children[index]:
                raise ValueError(f"pair tree: node {index} holds a placeholder but is not one pair's leaf")
            number = -ids[-1] - 1
            where = index if own else node["parent"]
            if where < 0:
                raise ValueError(f"pair {number}: an empty prompt")
            attached.setdefault(where, []).append(number)
    out_nodes: list[dict[str, Any]] = []
    rows: list[int] = []
    order: list[int] = []

    def emit(index: int, parent: int) -> None:
        here = parent
        if kept_ids[index]:  # a placeholder-only leaf vanishes: its pair's answers follow the parent
            here = len(out_nodes)
            ids = kept_ids[index]
            out_nodes.append({"input_ids": ids, "labels": [IGNORE_INDEX] * len(ids), "parent": parent})
        for number in attached.get(index, ()):
            order.append(number)
            for key in ("chosen_ids", "rejected_ids"):
                answer = list(pairs[number][key])
                rows.append(len(out_nodes))
                out_nodes.append({"input_ids": answer, "labels": answer, "parent": here})
        for child in children[index]:
            emit(child, here)

    emit(0, -1)
    return {"tree_nodes": out_nodes, "tree_rows": rows, "tree_pairs": order}


def pair_history_key(pair: dict[str, Any]) -> tuple[list[int], list[int], list[int]]:
    """Pairs in the order of their prompts (pairs that share a history are neighbours: ``data.step_order:
    histories``), then of their answers."""
    return list(pair["prompt_ids"]), list(pair["chosen_ids"]), list(pair["rejected_ids"])


def share_pairs_as_trees(
    pairs: Sequence[dict[str, Any]], max_seq_len: int, seed: int = 0, min_shared: int = MIN_SHARED_TOKENS
) -> tuple[list[list[Tree]], TreeSharingReport]:
    """One step's pairs as prefix trees packed best-fit by their size; each tree's ``tree_pairs`` are
    the pairs' numbers in ``pairs``."""
    return share_rows_as_trees(pairs, max_seq_len, seed, min_shared, items_of=pair_tree_items)
