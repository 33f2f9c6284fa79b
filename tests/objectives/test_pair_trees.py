"""``data.share_prefixes: tree`` on preference pairs whose prompts share history: the same steps on the
same pairs to the same losses as each pair packed alone, with the reference precomputed, per step, or
none (ORPO); what it cannot do is refused by key."""

from __future__ import annotations

import json
import math
import random

import pytest

from slipstream.train.config import ConfigError, load_config

from .test_pairs import WORDS, dpo_config, losses, records, run, write_pairs


def conversation_pairs(chats: int = 4, turns: int = 4, seed: int = 0) -> list[dict]:
    """A preference pair at every turn of each conversation: turn k's prompt is the conversation so far
    (earlier turns with their chosen answers), so a chat's pairs share their history at every level."""
    rng = random.Random(seed)

    def words(low: int, high: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(low, high)))

    rows = []
    for chat in range(chats):
        history = f"Chat {chat}. You are a guide to {words(10, 14)}."
        for _ in range(turns):
            history += f" Q: {words(3, 6)}?"
            chosen, rejected = words(3, 7), words(2, 8) + " no"
            rows.append({"prompt": history, "chosen": chosen, "rejected": rejected})
            history += f" A: {chosen}"
    return rows


def run_json(out) -> dict:
    return json.loads((out / "run.json").read_text())


@pytest.mark.parametrize(
    ("objective", "reference"), [("dpo", "precomputed"), ("dpo", "per_step"), ("orpo", "precomputed")]
)
def test_pair_trees_take_the_same_steps_on_the_same_pairs_to_the_same_losses(tmp_path, objective, reference):
    pairs = write_pairs(tmp_path, conversation_pairs())

    def config(mode: str):
        return dpo_config(
            tmp_path,
            pairs,
            mode,
            data={"share_prefixes": mode, "step_order": "histories", "max_seq_len": 256},
            training={"objective": objective, "steps": 3, "grad_accum": 2},
            preference={"reference": reference},
        )

    run(config("off"))
    run(config("tree"))
    off, tree = tmp_path / "off", tmp_path / "tree"
    assert losses(tree) == pytest.approx(losses(off), abs=1e-5)
    assert len(losses(off)) == 3
    shared = run_json(tree)["shared_prefixes"]
    assert shared["on"] and shared["layout"] == "tree"
    assert shared["tree"]["saved_fraction"] > 0.2  # the chats' histories run once
    assert "prefix trees across pairs" in shared["policy"]
    assert run_json(off)["shared_prefixes"]["on"] is False
    micro = {name: [r["micro_batches"] for r in records(out)] for name, out in (("off", off), ("tree", tree))}
    assert micro["off"] == [2, 2, 2] and sum(micro["tree"]) < sum(micro["off"])  # fewer rows: histories once


def test_pair_trees_fall_back_to_pairs_alone_where_nothing_is_shared(tmp_path):
    """Pairs that share no prompt: ``auto`` leaves them as they pack today, and says why."""
    pairs = write_pairs(tmp_path)  # unrelated prompts
    out = dpo_config(tmp_path, pairs, "auto", data={"share_prefixes": "auto"})
    run(out)
    shared = run_json(tmp_path / "auto")["shared_prefixes"]
    assert shared["on"] is False and "shared prefixes off (auto" in shared["policy"]


@pytest.mark.parametrize(
    ("sections", "words"),
    [
        ({"data": {"share_prefixes": "groups"}}, "data.share_prefixes groups is for SFT rows"),
        (
            {"data": {"share_prefixes": "tree"}, "preference": {"prefix_sharing": False}},
            "preference.prefix_sharing false",
        ),
        (
            {"data": {"share_prefixes": "tree"}, "speedups": {"chunked_loss": False}},
            "set speedups.chunked_loss true",
        ),
    ],
)
def test_what_pair_trees_cannot_do_is_refused_by_key(tmp_path, sections, words):
    pairs = write_pairs(tmp_path)
    with pytest.raises(ConfigError, match="data.share_prefixes") as error:
        load_config(dpo_config(tmp_path, pairs, **sections))
    assert words in str(error.value)


@pytest.mark.parametrize("reference", ["precomputed", "per_step"])
def test_in_bf16_a_pair_trees_reference_runs_in_its_layout_so_step_0_is_ln_2(tmp_path, reference):
    """The policy starts as the reference: a reference computed in another layout (each pair alone)
    differs from the trees' policy sums by bf16 rounding and moves step 0's loss off ln 2."""
    pairs = write_pairs(tmp_path, conversation_pairs(chats=2, turns=6))
    config = dpo_config(
        tmp_path,
        pairs,
        "bf16",
        model={"preset": "qwen3", "dtype": "bfloat16"},
        data={"share_prefixes": "tree", "step_order": "histories", "max_seq_len": 512},
        training={"steps": 1, "grad_accum": 2},
        preference={"reference": reference},
    )
    run(config)
    assert run_json(tmp_path / "bf16")["shared_prefixes"]["on"]
    assert losses(tmp_path / "bf16")[0] == pytest.approx(math.log(2), abs=1e-6)


@pytest.mark.multiprocess
@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_two_ranks_of_pair_trees_match_one_process_with_the_same_global_batch(tmp_path, strategy):
    """Each rank regroups its own pairs into trees and runs its reference in that layout (FSDP2: every
    rank as many forwards); the losses are one process's, whose trees hold both ranks' pairs."""
    import os
    import subprocess
    import sys

    import torch.distributed as dist

    from ..ports import free_port

    if not dist.is_available():
        pytest.skip("no torch.distributed")
    pairs = write_pairs(tmp_path, conversation_pairs())
    config = dpo_config(
        tmp_path,
        pairs,
        # 4 steps of 2 bins each: every rank a bin (a step of one bin would be refused by name)
        data={"share_prefixes": "tree", "step_order": "histories", "max_seq_len": 320},
        training={"steps": 3, "distributed": strategy},
    )

    def launch(args):
        done = subprocess.run(
            [sys.executable, *args], capture_output=True, text=True, timeout=300,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]

    single = ["-m", "slipstream", "train", str(config), "--set", f"output_dir={tmp_path / 'single'}"]
    launch([*single, "--set", "training.grad_accum=2"])
    ranks = ["-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", free_port()]
    launch([*ranks, "-m", "slipstream", "train", str(config), "--set", f"output_dir={tmp_path / 'ranks'}"])
    one, two = losses(tmp_path / "single"), losses(tmp_path / "ranks")
    assert abs(one[0] - math.log(2)) < 1e-5 and len(one) == len(two) == 3
    assert max(abs(a - b) / abs(a) for a, b in zip(one, two, strict=True)) <= 1e-5
    assert run_json(tmp_path / "ranks")["shared_prefixes"]["on"]


@pytest.mark.parametrize(
    ("order", "objective", "on"),
    [("shuffled", "dpo", False), ("histories", "dpo", True), ("shuffled", "orpo", True)],
)
def test_auto_keeps_pairs_alone_where_the_reference_would_run_every_epochs_new_layouts(
    tmp_path, monkeypatch, order, objective, on
):
    """Shuffled steps over two epochs are new step layouts each epoch: a precomputed reference in the
    trees' layout would run twice, which the cost model does not count, so ``auto`` says no (a
    reference-free objective, or the fixed steps of ``histories``, keep the trees). The cost model is
    made to favour the trees (its verdict is this machine's), so only that rule decides."""
    from slipstream.objectives.sharing import PrefixSharing

    def favour_trees(self, steps, cost):
        self.on, self.layout, self.policy = True, "tree", "shared prefixes on (auto: faked): the trees"
        return True

    monkeypatch.setattr(PrefixSharing, "decide", favour_trees)
    pairs = write_pairs(tmp_path, conversation_pairs())
    config = dpo_config(
        tmp_path, pairs, "auto",
        data={"share_prefixes": "auto", "step_order": order, "max_seq_len": 320},
        training={"objective": objective, "epochs": 2, "steps": None, "grad_accum": 2},
    )  # fmt: skip
    run(config)
    shared = run_json(tmp_path / "auto")["shared_prefixes"]
    assert shared["on"] is on, shared["policy"]
    if not on:
        assert "reference would run again in every epoch" in shared["policy"]
