"""``data.share_prefixes`` on GRPO's update (objectives/grpo_sharing.py): a micro-batch whose prompts share a
system prompt runs it once as a prefix tree, and ``slipstream train`` trains the same steps as with the
prompts once per group (fp32, to rounding); ``auto``'s per-micro-batch choice with the cost model faked
both ways; the refusals by key."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from slipstream.objectives.grpo_sharing import CompletionTrees
from slipstream.objectives.sharing import LayoutCost
from slipstream.packing.completions import completion_tokens
from slipstream.train.config import ConfigError, load_config
from slipstream.train.loop import train

from .test_grpo import grpo_config, records

SYSTEM = (
    "You are a careful assistant for arithmetic puzzles. Think about each question step by step, check the "
    "answer twice, and reply with the number only, without any words around it."
)


def system_config(folder: Path, mode: str, **sections) -> Path:
    path = grpo_config(folder, data={"max_seq_len": 160, "share_prefixes": mode}, **sections)
    rows = [
        {
            "prompt": [
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": f"What comes after {n}?"},
            ]
        }
        for n in range(8)
    ]
    (folder / "prompts.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@pytest.mark.parametrize("mode", ["tree", "auto"])
def test_train_with_trees_trains_the_steps_of_one_prompt_per_group(tmp_path, mode):
    """Two updates on one round (num_iterations 2: the old log-probs too) with the KL to the reference:
    the same losses, KL and gradient norms as today's layout, fewer tokens where trees ran."""
    runs = {}
    for name in ("off", mode):
        folder = tmp_path / name
        folder.mkdir()
        config = system_config(
            folder, name, training={"steps": 2, "grad_accum": 2}, grpo={"num_iterations": 2, "beta": 0.04}
        )
        train(load_config(config), progress=False)
        runs[name] = records(folder / "out")
        run = json.loads((folder / "out" / "run.json").read_text())
        policy = next(p for p in run["policies"] if p.startswith("grpo:"))
        assert ("prefix trees" in policy or "one prompt per group" in policy) == (name != "off"), policy
    off, shared = runs["off"], runs[mode]
    for a, b in zip(off, shared, strict=True):
        for key in ("loss", "kl", "grad_norm", "reward"):
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-7), key
        assert "tree_micro_batches" not in a
    first = shared[0]
    if mode == "tree":  # every micro-batch a tree, each running the system prompt once, not twice
        assert first["tree_micro_batches"] == 2
        assert first["update_tokens"] < first["update_tokens_today"]
    else:  # auto: whatever the cost model chose, the tokens say what ran
        assert 0 <= first["tree_micro_batches"] <= 2
        assert (first["update_tokens"] < first["update_tokens_today"]) == (first["tree_micro_batches"] > 0)


def groups_sharing(system: int, own: int, completions: list[int]) -> list[dict]:
    prompts = [list(range(1, system + 1)) + [500 + g] * own for g in range(2)]
    return [
        {"prompt_ids": p, "completions": [[700 + g * 50 + j] * n for j, n in enumerate(completions)]}
        for g, p in enumerate(prompts)
    ]


def fake_cost(call_seconds: float) -> LayoutCost:
    """A CPU cost model (a call per document) whose per-call cost is faked: a high one makes the trees'
    extra documents cost more than the tokens they save."""
    return LayoutCost(
        token_seconds=1e-6, call_seconds=call_seconds, pair_seconds=1e-9, layers=2, call_per_document=True
    )


@pytest.mark.parametrize(
    "cost, expected",
    [(fake_cost(0.0), True), (fake_cost(1.0), False), (None, True)],
    ids=["cheap-calls", "dear-calls", "no-cost-model"],
)
def test_auto_chooses_trees_per_micro_batch_by_the_cost_model(cost, expected):
    trees = CompletionTrees("auto", cost)
    groups = groups_sharing(system=40, own=3, completions=[4, 5, 6])
    packed, documents = trees.pack(groups, 1.0)
    counts = trees.take_step()
    assert counts.tree_micro_batches == int(expected)
    today = sum(completion_tokens(g) for g in groups)
    assert counts.tokens_today == today
    assert counts.tokens == (today - 40 if expected else today)
    assert packed.batch.num_tokens == counts.tokens == sum(len(d["input_ids"]) for d in documents)
    assert bool(packed.batch.parents) == expected


def test_auto_keeps_one_prompt_per_group_where_nothing_more_is_shared():
    trees = CompletionTrees("auto", fake_cost(0.0))
    groups = groups_sharing(system=0, own=20, completions=[4, 5])
    trees.pack(groups, 1.0)
    assert trees.take_step().tree_micro_batches == 0


def test_auto_keeps_longrope_models_off_trees():
    class Config:
        rope_scaling = {"rope_type": "longrope", "short_factor": [1.0], "long_factor": [2.0]}

    class Model:
        config = Config()

    made = CompletionTrees.make("auto", Model(), lambda: fake_cost(0.0))
    assert made.unable is not None and "longrope" in made.policy()
    made.pack(groups_sharing(system=40, own=3, completions=[4, 5]), 1.0)
    assert made.take_step().tree_micro_batches == 0
    assert CompletionTrees.make("off", Model(), None) is None


REFUSALS = [
    ({"data": {"share_prefixes": "groups"}}, "data.share_prefixes groups is for SFT rows"),
    ({"data": {"share_prefixes": "tree"}, "grpo": {"prefix_sharing": False}}, "grpo.prefix_sharing false"),
    ({"data": {"share_prefixes": "on"}, "speedups": {"chunked_loss": False}}, "speedups.chunked_loss"),
]


@pytest.mark.parametrize("sections, words", REFUSALS, ids=["groups", "no-prefix-sharing", "no-chunked-loss"])
def test_what_trees_cannot_do_is_refused_by_key(tmp_path, sections, words):
    config = grpo_config(tmp_path, **sections)
    with pytest.raises(ConfigError) as caught:
        load_config(config)
    message = str(caught.value)
    assert "\n" not in message and "data.share_prefixes" in message and words in message, message
