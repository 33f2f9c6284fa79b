"""``data.share_prefixes``: the same steps on the same rows whatever the layout; shared starts run once."""

from __future__ import annotations

import json
import re

import pytest

from slipstream.train.config import ConfigError, load_config
from slipstream.train.loop import train
from tests.bench.test_ab_shared_prefixes import chat_file
from tests.train.test_train import TINY, losses, write_config


def config(tmp_path, mode: str, name: str, response_only: bool = True, training=None, **speedups):
    out = tmp_path / name
    out.mkdir()
    data = {
        **TINY,
        "data": {
            "path": str(chat_file(tmp_path / "chats.jsonl", rows=16, system_words=60, longest=10)),
            "response_only": response_only,
            # ~1-2 rows a bin: a step of 4 micro-batches holds ~6 rows sharing one start
            "max_seq_len": 320,
            "share_prefixes": mode,
        },
        "training": training or {"epochs": 1, "grad_accum": 4, "checkpoint_every": 0},
        **({"speedups": speedups} if speedups else {}),
    }
    return load_config(write_config(out, data))


def micro_batches(out) -> list[int]:
    return [
        json.loads(line).get("micro_batches") for line in (out / "metrics.jsonl").read_text().splitlines()
    ]


@pytest.mark.parametrize("response_only", [True, False])
def test_sharing_takes_the_same_steps_on_the_same_rows_to_the_same_losses(tmp_path, response_only):
    _, shared = train(config(tmp_path, "on", "shared", response_only), progress=False)
    _, whole = train(config(tmp_path, "off", "whole", response_only), progress=False)
    found = shared["shared_prefixes"]
    assert found["on"] and found["rows_in_groups"] >= 12 and found["saved_fraction"] > 0.2, found
    assert "shared prefixes on" in found["policy"]
    assert "shared prefixes off" in whole["shared_prefixes"]["policy"]
    # the same number of steps (an epoch is the rows' bins, whatever the layout) ...
    shared_curve, whole_curve = losses(tmp_path / "shared" / "out"), losses(tmp_path / "whole" / "out")
    assert len(shared_curve) == len(whole_curve) >= 2
    # ... each in fewer micro-batches where the step's rows share their start (the speedup) ...
    assert micro_batches(tmp_path / "whole" / "out") == [4] * len(whole_curve)
    assert all(n < 4 for n in micro_batches(tmp_path / "shared" / "out"))
    # ... and, fp32, the same rows a step, the same loss and (every later step follows the gradients) the
    # same updates; without response_only the start is labelled, each of its tokens counted once per row
    assert shared_curve == pytest.approx(whole_curve, rel=1e-5)


def test_auto_decides_by_the_devices_cost_model_and_says_why_not_elsewhere(tmp_path):
    _, summary = train(config(tmp_path, "auto", "auto"), progress=False)
    found = summary["shared_prefixes"]
    assert re.match(r"shared prefixes on as .* \(auto: modelled ", found["policy"]), found
    assert found["modelled_seconds"]["shared_s"] < found["modelled_seconds"]["whole_s"]
    _, summary = train(config(tmp_path, "auto", "no-chunked", chunked_loss=False), progress=False)
    assert "speedups.chunked_loss is off" in summary["shared_prefixes"]["policy"]
    assert summary["shared_prefixes"]["on"] is False


def test_on_without_what_it_needs_is_refused_by_key(tmp_path):
    with pytest.raises(ConfigError, match=r"config\.yaml:\d+: data.share_prefixes on needs the chunked loss"):
        config(tmp_path, "on", "refused", chunked_loss=False)


def multi_turn_file(path, chats: int = 4, turns: int = 4, seed: int = 0):
    """Each chat of ``turns`` exchanges as ``turns`` rows (row k: the chat through the k-th answer), and
    its last turn answered twice: rows share their histories at every level, not one start."""
    import random

    from tests.bench.test_ab_shared_prefixes import WORDS

    rng = random.Random(seed)

    def words(lo, hi):
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))

    with path.open("w") as f:
        for _ in range(chats):
            messages = [{"role": "system", "content": words(30, 40)}]
            for turn in range(turns):
                messages += [
                    {"role": "user", "content": words(8, 16)},
                    {"role": "assistant", "content": words(6, 14)},
                ]
                f.write(json.dumps({"messages": messages}) + "\n")
                if turn == turns - 1:  # a second answer to the last question: a branch
                    other = [*messages[:-1], {"role": "assistant", "content": words(6, 14)}]
                    f.write(json.dumps({"messages": other}) + "\n")
    return path


@pytest.mark.parametrize("response_only", [True, False])
def test_prefix_trees_take_the_same_steps_on_the_same_rows_to_the_same_losses(tmp_path, response_only):
    def run(mode):
        out = tmp_path / f"{mode}-{response_only}"
        out.mkdir()
        data = {
            **TINY,
            "data": {
                "path": str(multi_turn_file(tmp_path / "turns.jsonl")),
                "response_only": response_only,
                "max_seq_len": 1024,
                "share_prefixes": mode,
            },
            "training": {"epochs": 1, "grad_accum": 4, "checkpoint_every": 0},
        }
        _, summary = train(load_config(write_config(out, data)), progress=False)
        return summary["shared_prefixes"], losses(out / "out"), micro_batches(out / "out")

    tree, tree_curve, tree_micro = run("tree")
    groups, groups_curve, _ = run("groups")
    whole, whole_curve, whole_micro = run("off")
    assert tree["on"] and tree["layout"] == "tree" and "as prefix trees" in tree["policy"], tree
    assert tree["tree"]["depth"] >= 3 and tree["tree"]["saved_fraction"] > groups["saved_fraction"] + 0.1, (
        tree
    )
    assert len(tree_curve) == len(whole_curve) >= 2
    assert sum(tree_micro) < sum(whole_micro)
    # fp32: the same rows a step, the same losses, every labelled shared token counted once per row
    assert tree_curve == pytest.approx(whole_curve, rel=1e-5)
    assert groups_curve == pytest.approx(whole_curve, rel=1e-5)


def test_tree_without_what_it_needs_is_refused_by_key(tmp_path):
    with pytest.raises(
        ConfigError, match=r"config\.yaml:\d+: data.share_prefixes tree needs the packed attention"
    ):
        config(tmp_path, "tree", "refused", packed_attention=False)


def test_history_steps_keep_a_chats_rows_together_for_every_layout(tmp_path):
    """data.step_order histories: the same steps for off and tree (the same losses, fp32), and the trees
    of those steps run fewer tokens than the shuffled plan's (a chat's rows in one step)."""

    def run(mode, order):
        out = tmp_path / f"{mode}-{order}"
        out.mkdir()
        data = {
            **TINY,
            "data": {
                "path": str(multi_turn_file(tmp_path / "turns.jsonl", chats=6, turns=4)),
                "response_only": True,
                "max_seq_len": 512,
                "share_prefixes": mode,
                "step_order": order,
            },
            "training": {"epochs": 1, "grad_accum": 2, "checkpoint_every": 0},
        }
        _, summary = train(load_config(write_config(out, data)), progress=False)
        return summary["shared_prefixes"], losses(out / "out")

    tree, tree_curve = run("tree", "histories")
    _, whole_curve = run("off", "histories")
    shuffled, _ = run("tree", "shuffled")
    assert len(tree_curve) == len(whole_curve) >= 2
    assert tree_curve == pytest.approx(whole_curve, rel=1e-5)
    assert tree["tree"]["shared_tokens"] < shuffled["tree"]["shared_tokens"], (tree, shuffled)


def test_history_steps_are_for_sft_rows_and_pairs_only(tmp_path):
    out = tmp_path / "grpo"
    out.mkdir()
    data = {**TINY, "data": {"step_order": "histories"}, "training": {"objective": "grpo", "steps": 2}}
    with pytest.raises(
        ConfigError, match=r"config\.yaml:\d+: data.step_order histories groups SFT rows or preference pairs"
    ):
        load_config(write_config(out, data))


def test_a_model_that_refuses_the_layout_runs_rows_whole_under_auto_and_stops_a_forced_one(
    tmp_path, monkeypatch
):
    """The first shared micro-batch runs once before step 0: a refusal there turns auto off (said in the
    policy line) and stops a forced layout before any step, naming data.share_prefixes."""
    from slipstream.packing.attention import sdpa
    from slipstream.packing.batch import UnsupportedSharedPrefix
    from slipstream.train.errors import TrainError

    per_document = sdpa._per_document

    def refusing(fn, batch, *args, **kwargs):
        if batch.has_prefixes:
            raise UnsupportedSharedPrefix(
                "this model cannot hold a shared prefix", refused="a test's refusal"
            )
        return per_document(fn, batch, *args, **kwargs)

    monkeypatch.setattr(sdpa, "_per_document", refusing)
    _, summary = train(config(tmp_path, "auto", "auto"), progress=False)
    found = summary["shared_prefixes"]
    assert found["on"] is False and "the model refuses them" in found["policy"], found
    assert len(losses(tmp_path / "auto" / "out")) >= 2
    with pytest.raises(TrainError, match="data.share_prefixes tree: this model cannot hold a shared prefix"):
        train(config(tmp_path, "tree", "tree"), progress=False)
    assert not (tmp_path / "tree" / "out" / "metrics.jsonl").exists() or not losses(tmp_path / "tree" / "out")
