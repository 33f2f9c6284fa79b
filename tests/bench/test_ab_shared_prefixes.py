"""``slipstream ab --share-prefixes``: the sharing arm trains groups, every other arm the same rows whole."""

from __future__ import annotations

import json
import random

import pytest

from slipstream.bench.ab_config import ABConfig
from slipstream.bench.arms import ARM_PRESETS, shares_prefixes
from slipstream.bench.render import markdown_report
from slipstream.bench.runner import prepare_bins, run_ab
from slipstream.data.prefix_groups import is_grouped, unshared_tokens, whole_rows_plan

WORDS = [
    "the",
    "agent",
    "reads",
    "a",
    "ticket",
    "checks",
    "the",
    "order",
    "then",
    "calls",
    "a",
    "tool",
    "and",
    "answers",
    "with",
    "care",
]


def chat_file(path, rows: int = 40, seed: int = 0, system_words: int = 120, longest: int = 30):
    """``rows`` chats (JSONL at ``path``) that all start with one system prompt of ``system_words`` words."""
    rng = random.Random(seed)
    system = " ".join(rng.choice(WORDS) for _ in range(system_words))  # every row's long shared start
    with path.open("w") as f:
        for _ in range(rows):
            question = " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 20)))
            answer = " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, longest)))
            messages = [
                {"role": "system", "content": system},
                {"role": "user", "content": question},
                {"role": "assistant", "content": answer},
            ]
            f.write(json.dumps({"messages": messages}) + "\n")
    return path


def config(tmp_path, **overrides) -> ABConfig:
    options = dict(
        model="qwen3",
        data=str(chat_file(tmp_path / "chats.jsonl")),
        response_only=True,
        max_seq_len=512,
        steps=3,
        warmup=1,
        threads=1,
        arms=("stock-packed", "slipstream-no-prefix-sharing", "slipstream"),
    )
    return ABConfig(**(options | overrides))


def test_a_grouped_plan_unpacks_into_the_same_rows_per_step(tmp_path):
    plan, _, packing = prepare_bins(config(tmp_path, share_prefixes="on"))
    assert is_grouped(plan) and packing["sharing"]["saved_fraction"] > 0.3
    whole = whole_rows_plan(plan, 512)
    for grouped_step, whole_step in zip(plan, whole, strict=True):
        assert sum(unshared_tokens(groups) for groups in grouped_step) == sum(
            unshared_tokens(docs) for docs in whole_step
        )
        assert all(sum(len(d["input_ids"]) for d in docs) <= 512 for docs in whole_step)
    off, _, packing = prepare_bins(config(tmp_path, share_prefixes="off"))
    assert not is_grouped(off) and "off" in packing["sharing_policy"]


def test_only_slipstream_arms_that_can_honour_groups_share():
    assert shares_prefixes("slipstream")
    for arm in ("stock-packed", "trl", "slipstream-no-prefix-sharing", "slipstream-no-chunked-loss"):
        assert not shares_prefixes(arm), arm
    assert ARM_PRESETS["shared-prefixes"][-1] == "slipstream"


def test_sequential_batching_cannot_share():
    with pytest.raises(ValueError, match="share_prefixes on packs groups"):
        ABConfig(share_prefixes="on", batching="sequential")


@pytest.mark.slow  # three tiny arms, a few steps: tens of seconds on 2 cores
def test_sharing_arm_trains_the_same_rows_to_the_same_loss(tmp_path):
    record = run_ab(config(tmp_path, share_prefixes="on"), progress=False)
    runs, summary = record["runs"], record["summary"]
    tokens = {arm: tuple(runs[arm][0]["tokens"]) for arm in summary}
    assert len(set(tokens.values())) == 1  # every row counted whole in every arm
    for arm in summary:
        assert summary[arm]["loss_vs_stock-packed"] in ("identical", "within tolerance"), arm
    loss = {arm: runs[arm][0]["loss"] for arm in summary}
    assert loss["slipstream"] == pytest.approx(loss["slipstream-no-prefix-sharing"], rel=1e-4)
    assert "speedup_vs_slipstream-no-prefix-sharing" in summary["slipstream"]
    assert "Rows sharing a start: shared prefixes on" in markdown_report(record)
