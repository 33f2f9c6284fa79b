"""Rows as a token trie (slipstream.data.prefix_tree): each shared span once, ids and labels alike, and the
tokens it saves against the rows whole and against today's one shared start per group."""

from __future__ import annotations

import random

import pytest

from slipstream.data.prefix_tree import build_trie, trie_report


def row(ids, labels=None):
    return {"input_ids": list(ids), "labels": list(labels) if labels is not None else list(ids)}


def spelled(root, count):
    """Each row as its path from the root spells it (ids, labels)."""
    found = {}

    def walk(node, ids, labels):
        ids, labels = ids + node.ids, labels + node.labels
        for index in node.ends:
            found[index] = (ids, labels)
        for child in node.children:
            walk(child, ids, labels)

    walk(root, [], [])
    return [found[i] for i in range(count)]


def test_shared_spans_are_held_once_at_every_level():
    rows = [row([1, 2, 3, 4]), row([1, 2, 3, 5, 6]), row([1, 2, 7]), row([8, 9])]
    root = build_trie(rows)
    report = trie_report(rows, root)
    assert [(n.ids, d) for n, d in root.walk() if d] == [
        ([1, 2], 1),
        ([3], 2),
        ([4], 3),
        ([5, 6], 3),
        ([7], 2),
        ([8, 9], 1),
    ]
    assert (report.whole, report.trie, report.depth) == (14, 9, 3)
    assert report.tokens_by_level == {1: 4, 2: 2, 3: 3}
    assert report.saved_by_level == {1: 2 * 2, 2: 1, 3: 0}  # [1, 2] by 3 rows, [3] by 2
    assert sum(report.saved_by_level.values()) == report.whole - report.trie


def test_a_span_labelled_differently_is_not_shared():
    rows = [row([1, 2, 3], [-100, -100, 3]), row([1, 2, 3], [-100, 2, 3])]
    root = build_trie(rows)
    assert [n.ids for n, d in root.walk() if d] == [[1], [2, 3], [2, 3]]
    assert trie_report(rows, root).trie == 5


def test_a_row_inside_another_ends_on_its_own_node():
    rows = [row([1, 2, 3, 4]), row([1, 2])]
    root = build_trie(rows)
    assert spelled(root, 2) == [([1, 2, 3, 4], [1, 2, 3, 4]), ([1, 2], [1, 2])]
    assert trie_report(rows, root).trie == 4


def test_mismatched_ids_and_labels_are_refused_naming_the_row():
    with pytest.raises(ValueError, match="row 1: 2 input_ids but 1 labels"):
        build_trie([row([1]), {"input_ids": [1, 2], "labels": [1]}])


def test_random_rows_are_spelled_back_and_the_trie_never_runs_more():
    rng = random.Random(0)
    for _ in range(30):
        stems = [[rng.randrange(6) for _ in range(rng.randrange(1, 6))] for _ in range(3)]
        rows = []
        for _ in range(rng.randrange(1, 12)):
            ids = list(rng.choice(stems)) + [rng.randrange(6) for _ in range(rng.randrange(0, 5))]
            ids = ids or [0]
            rows.append(row(ids, [i if rng.random() < 0.8 else -100 for i in ids]))
        root = build_trie(rows)
        assert spelled(root, len(rows)) == [(r["input_ids"], r["labels"]) for r in rows]
        report = trie_report(rows, root)
        assert report.trie <= report.one_start <= report.whole


def test_turn_by_turn_rows_of_a_reasoning_chat_share_every_history_once():
    """Row k of a K-turn chat: the history with earlier reasoning dropped, then turn k with its reasoning
    (Qwen3's rule): row k is not a prefix of row k+1, but they share the history up to turn k. One shared
    start holds only what every row begins with; the trie holds every history once."""
    rng = random.Random(1)
    system = [rng.randrange(100, 200) for _ in range(40)]
    turns = 6
    users = [[rng.randrange(200, 300) for _ in range(12)] for _ in range(turns)]
    answers = [[rng.randrange(300, 400) for _ in range(20)] for _ in range(turns)]
    thoughts = [[rng.randrange(400, 500) for _ in range(30)] for _ in range(turns)]
    rows = []
    for k in range(turns):
        history = [t for i in range(k) for t in users[i] + answers[i]]
        rows.append(row(system + history + users[k] + thoughts[k] + answers[k]))
    report = trie_report(rows)
    assert report.trie < report.one_start < report.whole
    shared_once = len(system) + sum(map(len, users)) + sum(map(len, answers)) * 2 + sum(map(len, thoughts))
    assert report.trie == shared_once - len(answers[-1])  # the last turn's short answer no row holds
    assert report.depth == turns
