"""``slipstream ab --objective dpo``: the pair arms, their verdicts, and one short real run."""

import json
import math

import pytest

from slipstream.bench.arms import ARM_PRESETS, ARM_SPECS
from slipstream.bench.command import ab_config
from slipstream.bench.render import markdown_report
from slipstream.bench.runner import run_ab, summarize
from slipstream.bench.stats import margin_parity

ROWS = [
    {
        "prompt": f"question {i} about the number {i * 7} and its neighbours {i + 1} {i + 2} {i + 3}",
        "chosen": f"the answer is {i * 7} thank you",
        "rejected": f"no idea {i}",
    }
    for i in range(40)
]


@pytest.fixture
def pairs_file(tmp_path):
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in ROWS))
    return path


def test_the_dpo_preset_holds_pair_arms_only():
    assert all(ARM_SPECS[arm].pairs for arm in ARM_PRESETS["dpo"])
    assert ARM_SPECS["slipstream-dpo"].pairs == "shared"
    assert ARM_SPECS["slipstream-dpo-no-prefix-sharing"].pairs == "unshared"


def test_a_dpo_ab_refuses_document_arms_and_a_missing_file(pairs_file):
    with pytest.raises(ValueError, match=r"\['slipstream'\] train another objective, sft"):
        ab_config(objective="dpo", data=str(pairs_file), arms=("slipstream", "slipstream-dpo"))
    with pytest.raises(ValueError, match="needs preference pairs: set data.path"):
        ab_config(objective="dpo", arms=ARM_PRESETS["dpo"])
    with pytest.raises(ValueError, match="train another objective, dpo \\(add --objective dpo"):
        ab_config(arms=("slipstream-dpo",))


def test_reward_margins_are_judged_scaled_then_against_the_sensitivity():
    same = margin_parity([0.0, 0.05, 0.1], [0.0, 0.05, 0.1], "float32", 0.1)
    assert same.verdict == "within tolerance"
    moved = margin_parity([0.0, 0.05, 0.1], [0.0, 0.06, 0.12], "float32", 0.1)
    assert moved.verdict == "differs" and moved.worst_step == 2
    # the run's own sensitivity moved the margin as far: drift, not a difference
    drift = margin_parity([0.0, 0.05, 0.1], [0.0, 0.06, 0.12], "float32", 0.1, sensitivity=[0.0, 0.055, 0.11])
    assert drift.verdict == "drift within sensitivity"


def test_the_shared_arm_gets_a_speedup_against_the_unshared_one():
    config = ab_config(steps=3, warmup=1)  # summarize reads warmup, seed and beta (0.1)
    run = {
        "step_s": [5.0, 2.0, 2.0],
        "tokens": [100] * 3,
        "loss": [math.log(2), 0.6, 0.5],
        "grad_norm": [1.0] * 3,
        "peak_memory_mb": 1.0,
        "memory_kind": "cpu peak RSS",
        "host_syncs_per_step": 0,
        "attn_implementation": "x",
        "pairs": [4] * 3,
        "reward_margin": [0.0, 0.1, 0.2],
        "reward_accuracy": [0.0, 1.0, 1.0],
        "reference_pass_s": 1.5,
    }
    runs = {
        "trl-dpo": [{**run, "step_s": [5.0, 4.0, 4.0]}],
        "slipstream-dpo-no-prefix-sharing": [{**run, "step_s": [5.0, 3.0, 3.0]}],
        "slipstream-dpo": [run],
    }
    summary = summarize(config, runs)
    shared = summary["slipstream-dpo"]
    assert shared["speedup_vs_trl-dpo"] == pytest.approx(2.0)
    assert shared["speedup_vs_slipstream-dpo-no-prefix-sharing"] == pytest.approx(1.5)
    assert shared["pairs_per_s"] == pytest.approx(2.0) and shared["reference_pass_s"] == 1.5
    assert shared["reward_margin_parity"]["verdict"] == "within tolerance"


@pytest.mark.slow
def test_a_short_dpo_ab_trains_the_same_pairs_in_every_arm(pairs_file, tmp_path):
    """The demo shape in fp32, three steps: every arm starts at ln 2 (policy = reference) and the
    slipstream arms' loss and reward-margin curves agree with TRL's."""
    pytest.importorskip("trl")
    arms = ("trl-dpo", "slipstream-dpo-no-prefix-sharing", "slipstream-dpo")
    config = ab_config(
        model="demo",
        layers=2,
        data=str(pairs_file),
        objective="dpo",
        arms=arms,
        steps=3,
        warmup=1,
        max_seq_len=256,
        lora_rank=4,
        lr=1e-3,
        dtype="float32",
        out_dir=str(tmp_path / "ab"),
    )
    record = run_ab(config, progress=False)
    for arm in arms:
        assert record["runs"][arm][0]["loss"][0] == pytest.approx(math.log(2), abs=1e-6)
    for arm in arms[1:]:
        summary = record["summary"][arm]
        assert summary["loss_vs_trl-dpo"] in ("identical", "within tolerance"), summary["loss_parity"]
        assert summary["reward_margin_parity"]["verdict"] != "differs", summary["reward_margin_parity"]
        assert summary["host_syncs_per_step"] == 0
    assert record["packing"]["pairs_trained"] > 0
    assert "Preference pairs:" in markdown_report(record)


def conversation_rows(chats: int = 6, turns: int = 4) -> list[dict]:
    """A pair at every turn of each chat: turn k's prompt is the chat so far (pairs share histories)."""
    rows = []
    for chat in range(chats):
        history = f"chat {chat} about the numbers {chat * 3} {chat * 5} {chat * 7} and what follows them"
        for turn in range(turns):
            history += f" question {turn} about {chat + turn}?"
            chosen = f"the answer is {(chat + 1) * (turn + 2)}"
            rows.append({"prompt": history, "chosen": chosen, "rejected": f"no idea {turn}"})
            history += f" {chosen}."
    return rows


def test_the_dpo_trees_preset_shares_histories_across_pairs_on_the_steps_of_histories(tmp_path):
    from slipstream.bench.arms import train_config_of
    from slipstream.bench.runner import prepare_bins

    assert ARM_PRESETS["dpo-trees"] == ("trl-dpo", "slipstream-dpo", "slipstream-dpo-tree")
    path = tmp_path / "chats.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in conversation_rows()))
    config = ab_config(
        objective="dpo", data=str(path), preset="dpo-trees", steps=3, warmup=1, grad_accum=1, max_seq_len=512,
        step_order="histories",
    )  # fmt: skip
    assert train_config_of(config, "slipstream-dpo-tree").data.share_prefixes == "tree"
    assert train_config_of(config, "slipstream-dpo").data.share_prefixes == "off"
    plan, _, packing = prepare_bins(config)
    from slipstream.data.pair_trees import pair_history_key

    every = sorted((p for step in plan for micro in step for p in micro), key=pair_history_key)
    rank = {id(pair): number for number, pair in enumerate(every)}
    for step in plan:  # a step's pairs are neighbours in the order of their prompts: chats' histories
        numbers = sorted(rank[id(p)] for micro in step for p in micro)
        assert numbers == list(range(numbers[0], numbers[0] + len(numbers)))
    assert packing["pairs_trained"] == sum(len(micro) for step in plan for micro in step)


@pytest.mark.slow
def test_a_short_dpo_trees_ab_trains_the_same_pairs_to_the_same_losses(tmp_path):
    path = tmp_path / "chats.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in conversation_rows()))
    arms = ("slipstream-dpo", "slipstream-dpo-tree")
    config = ab_config(
        model="demo", layers=2, data=str(path), objective="dpo", arms=arms, steps=3, warmup=1,
        max_seq_len=512, lora_rank=4, lr=1e-3, dtype="float32", step_order="histories",
        out_dir=str(tmp_path / "ab"),
    )  # fmt: skip
    record = run_ab(config, progress=False)
    summary = record["summary"]["slipstream-dpo-tree"]
    assert summary["loss_vs_slipstream-dpo"] in ("identical", "within tolerance"), summary["loss_parity"]
    assert summary["host_syncs_per_step"] == 0
