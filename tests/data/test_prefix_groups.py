"""Rows grouped by the start they share: what is grouped, what is saved, and that nothing is lost."""

from __future__ import annotations

import random
from collections import Counter

from slipstream.data.labels import IGNORE_INDEX
from slipstream.data.prefix_groups import (
    MIN_SHARED_TOKENS,
    combined,
    find_groups,
    group_rows,
    group_tokens,
    share_rows,
)


def row(prefix: list[int], own: list[int], label_prefix: bool = False) -> dict:
    labels = (prefix if label_prefix else [IGNORE_INDEX] * len(prefix)) + own
    return {"input_ids": prefix + own, "labels": labels}


def rows_key(rows) -> Counter:
    return Counter((tuple(r["input_ids"]), tuple(r["labels"])) for r in rows)


def tool_set(rng: random.Random, rows: int = 40, system: int = 300) -> list[dict]:
    prompt = [rng.randrange(5, 1000) for _ in range(system)]
    return [row(prompt, [rng.randrange(5, 1000) for _ in range(rng.randint(20, 80))]) for _ in range(rows)]


def test_rows_sharing_a_system_prompt_become_one_group_and_nothing_is_lost():
    rng = random.Random(0)
    samples = tool_set(rng)
    bins, sharing = share_rows(samples, max_seq_len=1024)
    groups = [g for b in bins for g in b]
    assert rows_key(r for g in groups for r in group_rows(g)) == rows_key(samples)
    assert sharing.groups == 1 and sharing.rows_in_groups == 40
    assert sharing.longest_shared == 300
    assert all(sum(group_tokens(g) for g in b) <= 1024 for b in bins)
    assert all(len(g["prefix_ids"]) in (0, 300) for g in groups)
    assert sharing.shared_tokens == sum(group_tokens(g) for g in groups)
    assert sharing.unshared_tokens == sum(len(s["input_ids"]) for s in samples)
    # every part that holds the prompt once saves it for each row beyond the first
    assert sharing.saved_tokens == sum(300 * (len(g["continuations"]) - 1) for g in groups if g["prefix_ids"])
    assert sharing.saved_fraction > 0.5


def test_a_group_split_to_fit_holds_its_start_in_every_part():
    samples = tool_set(random.Random(1), rows=30, system=200)
    bins, sharing = share_rows(samples, max_seq_len=400)
    groups = [g for b in bins for g in b]
    assert sharing.parts > 1
    assert all(group_tokens(g) <= 400 for g in groups)
    assert rows_key(r for g in groups for r in group_rows(g)) == rows_key(samples)


def test_answers_to_one_prompt_group_apart_from_rows_that_only_share_a_short_system_prompt():
    rng = random.Random(2)
    system = [rng.randrange(5, 1000) for _ in range(MIN_SHARED_TOKENS + 4)]
    samples = []
    for _ in range(6):
        prompt = system + [rng.randrange(5, 1000) for _ in range(120)]
        samples += [row(prompt, [rng.randrange(5, 1000) for _ in range(60)]) for _ in range(4)]
    rng.shuffle(samples)
    found = find_groups(samples)
    assert sorted(len(members) for _, members in found) == [4] * 6
    assert {shared for shared, _ in found} == {len(system) + 120}


def test_only_tokens_labelled_alike_are_shared():
    prefix = list(range(10, 60))
    a = row(prefix, [7, 8, 9])
    b = {"input_ids": prefix + [4, 5], "labels": [IGNORE_INDEX] * 30 + prefix[30:] + [4, 5]}
    ((shared, members),) = find_groups([a, b])
    assert shared == 30 and sorted(members) == [0, 1]


def test_every_row_keeps_a_token_of_its_own():
    prefix = list(range(10, 60))
    samples = [row(prefix, [], label_prefix=True), row(prefix, [], label_prefix=True), row(prefix, [3], True)]
    bins, _ = share_rows(samples, max_seq_len=512)
    groups = [g for b in bins for g in b]
    assert all(c["input_ids"] for g in groups for c in g["continuations"])
    assert rows_key(r for g in groups for r in group_rows(g)) == rows_key(samples)


def test_rows_that_share_little_are_not_grouped():
    rng = random.Random(3)
    samples = [row([1, 2, 3], [rng.randrange(5, 1000) for _ in range(50)]) for _ in range(20)]
    bins, sharing = share_rows(samples, max_seq_len=512)
    assert sharing.groups == 0 and sharing.saved_tokens == 0
    assert all(not g["prefix_ids"] and len(g["continuations"]) == 1 for b in bins for g in b)
    assert "no two of 20 rows" in sharing.summary()


def test_one_steps_rows_regroup_into_fewer_bins_and_the_reports_add_up():
    rng = random.Random(4)
    rows = tool_set(rng, rows=8)  # 8 rows of ~350 tokens: 8 bins of 512 whole, shared 300 + 8 x ~50
    bins, report = share_rows(rows, max_seq_len=512)
    assert len(bins) < 8 and report.groups >= 1
    regrouped = [r for b in bins for g in b for r in group_rows(g)]
    assert rows_key(regrouped) == rows_key(rows)  # the same rows, nothing lost or added
    assert report.shared_tokens == sum(group_tokens(g) for b in bins for g in b) < report.unshared_tokens
    other = share_rows(tool_set(random.Random(5), rows=4, system=4), max_seq_len=512)[1]
    total = combined([report, other])
    assert total.rows == 12 and total.saved_tokens == report.saved_tokens + other.saved_tokens
    assert total.longest_shared == max(report.longest_shared, other.longest_shared)


def test_same_seed_same_bins():
    samples = tool_set(random.Random(5))
    first = share_rows(samples, 512, seed=3)[0]
    assert first == share_rows(samples, 512, seed=3)[0]
