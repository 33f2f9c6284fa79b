"""``slipstream ab --share-prefixes``: every arm gets the same rows a step; the sharing arm regroups them."""

from __future__ import annotations

import json
import random

import pytest

from slipstream.bench.ab_config import ABConfig
from slipstream.bench.arms import ARM_PRESETS, shares_prefixes
from slipstream.bench.command import ab_config
from slipstream.bench.render import markdown_report
from slipstream.bench.runner import prepare_bins, run_ab
from slipstream.data.prefix_groups import unshared_tokens
from slipstream.data.steps import step_order
from slipstream.objectives.sharing import PrefixSharing

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
        grad_accum=4,  # a step's rows (~400 tokens each, a bin apiece) share their start: 4 micro-batches -> 1
        warmup=1,
        threads=1,
        arms=("stock-packed", "slipstream-no-prefix-sharing", "slipstream"),
    )
    return ab_config(**(options | overrides))


def test_every_arm_gets_each_steps_rows_whole_and_the_sharing_arm_regroups_the_same_rows(tmp_path):
    plan, _, packing = prepare_bins(config(tmp_path, share_prefixes="on", grad_accum=2))
    assert packing["sharing"]["saved_fraction"] > 0.3
    assert all(
        "continuations" not in doc for step in plan for docs in step for doc in docs
    )  # rows, never groups
    assert all(sum(len(d["input_ids"]) for d in docs) <= 512 for step in plan for docs in step)
    # the steps take the bins in train's order (data.steps), grad_accum a step
    off, _, packing_off = prepare_bins(config(tmp_path, share_prefixes="off", grad_accum=2))
    assert off == plan and "sharing" not in packing_off and "off" in packing_off["sharing_policy"]
    assert len(plan) == 3 and all(len(step) == 2 for step in plan)
    sharing = PrefixSharing("on", 512, seed=0)
    for number, step in enumerate(plan):
        shared = sharing.share(step, number)
        assert len(shared) < len(step)  # fewer micro-batches: the speedup
        assert sum(unshared_tokens(groups) for groups in shared) == sum(
            unshared_tokens(docs) for docs in step
        )


def test_the_plan_takes_the_bins_in_trains_order(tmp_path):
    from slipstream.bench.inputs import ab_tokenizer
    from slipstream.data import pack_samples
    from slipstream.objectives.sft import SFT

    cfg = config(tmp_path, share_prefixes="off", grad_accum=2)
    plan, _, _ = prepare_bins(cfg)
    samples, _ = SFT(cfg.train).samples(ab_tokenizer(cfg))
    bins, _ = pack_samples(samples, 512, seed=cfg.train.seed)
    bins_for = step_order(len(bins), 2, cfg.train.seed)
    expected = [[[d["input_ids"] for d in bins[i]] for i in bins_for(step)] for step in range(3)]
    assert [[[d["input_ids"] for d in docs] for docs in step] for step in plan] == expected


def test_only_slipstream_arms_that_can_honour_groups_share():
    assert shares_prefixes("slipstream")
    for arm in ("stock-packed", "trl", "slipstream-no-prefix-sharing", "slipstream-no-chunked-loss"):
        assert not shares_prefixes(arm), arm
    assert ARM_PRESETS["shared-prefixes"][-1] == "slipstream"


def test_sequential_batching_shares_each_steps_rows_too(tmp_path):
    plan, _, packing = prepare_bins(config(tmp_path, share_prefixes="on", batching="sequential"))
    assert packing["sharing"]["saved_fraction"] > 0.3 and plan


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
    report = markdown_report(record)
    assert (
        "Rows sharing a start:" in report
        and "slipstream: shared prefixes on as " in report
        and "(on: the layout that runs fewer tokens)" in report
    )
