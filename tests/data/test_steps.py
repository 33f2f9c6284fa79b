"""data.steps: which rows form each step. ``histories`` keeps rows that share a history in one step."""

from __future__ import annotations

import random

import pytest

from slipstream.data.binpack import pack_samples
from slipstream.data.prefix_tree import tree_items
from slipstream.data.steps import block_order, history_steps, step_order


def conversation_rows(chats: int, turns: int, seed: int = 0) -> list[dict]:
    """Each chat's rows, one per turn (row k: the chat's first k exchanges), chats in a random order."""
    rng = random.Random(seed)
    rows = []
    for chat in range(chats):
        history = [1000 + chat] + [rng.randrange(1, 900) for _ in range(40)]  # a system prompt of its own
        for _ in range(turns):
            history = history + [rng.randrange(1, 900) for _ in range(rng.randrange(10, 40))]
            rows.append({"input_ids": list(history), "labels": list(history)})
    rng.shuffle(rows)
    return rows


def key(row):
    return tuple(row["input_ids"])


@pytest.mark.parametrize("per_step, max_seq_len", [(1, 512), (2, 512), (4, 300), (3, 1024)])
def test_every_row_once_in_steps_of_at_most_per_step_bins(per_step, max_seq_len):
    rows = [r for r in conversation_rows(9, 5) if len(r["input_ids"]) <= max_seq_len]
    bins, blocks = history_steps(rows, max_seq_len, per_step)
    assert sorted(key(r) for b in bins for r in b) == sorted(key(r) for r in rows)
    assert all(sum(len(r["input_ids"]) for r in b) <= max_seq_len for b in bins)
    assert [i for block in blocks for i in block] == list(range(len(bins)))
    assert all(1 <= len(block) <= per_step for block in blocks)
    assert (
        all(len(block) == per_step for block in blocks[:-1]) or per_step > 1
    )  # best-fit may leave one short


def test_a_conversations_rows_share_a_step_where_the_shuffled_order_spreads_them():
    rows = conversation_rows(12, 5)
    bins, blocks = history_steps(rows, 1024, 2)
    # a chat's rows (~750 tokens) are neighbours in the rows' order: each chat in one step, or two where
    # a step ends inside it
    steps_of = {}
    for number, block in enumerate(blocks):
        for i in block:
            for row in bins[i]:
                steps_of.setdefault(row["input_ids"][0], set()).add(number)
    assert max(len(steps) for steps in steps_of.values()) <= 2 and len(steps_of) == 12

    # what a step's trees run, against the shuffled plan's steps of as many bins
    def tree_tokens(step_rows):
        return tree_items(step_rows, 1024, min_shared=1)[1].shared_tokens

    histories = sum(tree_tokens([r for i in block for r in bins[i]]) for block in blocks)
    shuffled_bins, _ = pack_samples(rows, 1024, seed=0)
    order = step_order(len(shuffled_bins), 2, 0)
    steps = -(-len(shuffled_bins) // 2)
    shuffled = sum(tree_tokens([r for i in order(s) for r in shuffled_bins[i]]) for s in range(steps))
    assert histories < 0.8 * shuffled


def test_block_order_is_a_seeded_permutation_of_the_steps_every_epoch():
    blocks = [[0, 1], [2, 3], [4]]
    order = block_order(blocks, seed=3)
    first, second = [order(s) for s in range(3)], [order(s) for s in range(3, 6)]
    assert sorted(map(tuple, first)) == sorted(map(tuple, blocks)) == sorted(map(tuple, second))
    assert [block_order(blocks, seed=3)(s) for s in range(6)] == first + second
    assert any([block_order(blocks, seed=s)(0) for s in range(10)][k] != first[0] for k in range(10))
    with pytest.raises(ValueError, match="no steps"):
        block_order([], 0)
