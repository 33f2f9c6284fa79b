"""``training.objective: reward``: packed pairs against each sequence run alone (rewards and LoRA gradients),
a short run with held-out accuracy, margins, what is refused, and the exported sequence classifier scored
identically by ``grpo.rewards`` and TRL's ``GRPOTrainer``."""

from __future__ import annotations

import json
import math

import pytest
import torch
from peft import LoraConfig, get_peft_model

from slipstream.cli import main
from slipstream.models import build_model
from slipstream.models.heads import reward_scores
from slipstream.optimize import optimize
from slipstream.packing.pairs import collate_pairs
from slipstream.speedups import Speedups
from slipstream.train.config import ConfigError, load_config
from tests.objectives.test_pairs import dpo_config, pair_rows, records, run, write_pairs

VOCAB, PAD = 96, 7
PAIRS = [
    {"prompt_ids": [5, 9, 14, 3, 22, 6], "chosen_ids": [31, 8, 17], "rejected_ids": [40, 41, 2, 9, 11]},
    # answers ending with the pad id (EOS where EOS pads): scored at the token before, as transformers does
    {"prompt_ids": [12, 6, 6, 50], "chosen_ids": [70, 71, 72, PAD], "rejected_ids": [19, PAD]},
    # a one-token rejected answer, and one that is only the pad id (scored at the prompt's last token)
    {"prompt_ids": [88, 1, 2, 3, 4, 5, 6], "chosen_ids": [9], "rejected_ids": [PAD]},
    {"prompt_ids": [30, 31], "chosen_ids": [60, 61, 62, 63, 64, 65], "rejected_ids": [10]},
]


def _reward_model(preset: str = "qwen3"):
    model = build_model(preset, vocab_size=VOCAB, seed=1, dtype=torch.float32, head="reward")
    model.config.pad_token_id = PAD
    return model


def _with_lora(model):
    torch.manual_seed(0)
    model = get_peft_model(
        model, LoraConfig(r=4, target_modules=["q_proj", "v_proj", "up_proj"], task_type="SEQ_CLS")
    )
    with torch.no_grad():  # a trained adapter: B away from zero, so its gradients and effect show
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.05)
    return model


def _gradients(model) -> dict[str, torch.Tensor]:
    found = {name: param.grad.clone() for name, param in model.named_parameters() if param.grad is not None}
    model.zero_grad()
    return found


@pytest.mark.parametrize("preset", ["qwen3", "llama", "qwen3-sliding"])
@pytest.mark.parametrize("prefix_sharing", [True, False])
def test_packed_rewards_and_lora_gradients_match_each_sequence_alone(preset, prefix_sharing):
    model = _with_lora(_reward_model(preset))
    optimize(model, Speedups())
    model.train()
    weights = torch.linspace(0.5, 2.0, 2 * len(PAIRS))  # each reward its own weight in the gradient
    alone = []
    for pair in PAIRS:
        for key in ("chosen_ids", "rejected_ids"):
            ids = torch.tensor([pair["prompt_ids"] + pair[key]])
            alone.append(model(input_ids=ids, use_cache=False).logits.reshape(()))
    alone = torch.stack(alone).float()
    (alone * weights).sum().backward()
    expected = _gradients(model)
    packed = reward_scores(model, collate_pairs(PAIRS, prefix_sharing, pad_id=PAD))
    (packed * weights).sum().backward()
    got = _gradients(model)
    torch.testing.assert_close(packed, alone.detach(), atol=1e-5, rtol=1e-5)
    assert got.keys() == expected.keys() and any("score" in name for name in got)  # the head trains
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], atol=1e-5, rtol=1e-5, msg=name)


def test_without_the_pad_id_the_last_token_is_read():
    batch = collate_pairs(PAIRS[1:2], True, pad_id=None)
    # prompt 0-3, chosen 4-7, rejected 8-9: every answer's own last token
    assert batch.answers.ends.tolist() == [7, 9]
    assert collate_pairs(PAIRS[1:2], True, pad_id=PAD).answers.ends.tolist() == [6, 8]


# ----------------------------------------------------------------------------- a run


def reward_config(tmp_path, rows=None, **sections):
    pairs = write_pairs(tmp_path, rows if rows is not None else pair_rows(24))
    training = {"objective": "reward", "steps": 6, **sections.pop("training", {})}
    return dpo_config(tmp_path, pairs, training=training, **sections)


def test_a_reward_model_trains_and_its_held_out_accuracy_is_reported(tmp_path):
    config = reward_config(
        tmp_path,
        data={"eval_fraction": 0.25},
        training={"eval_every": 3, "eval_at_start": True},
        optimizer={"lr": 3e-2},
    )
    _, summary = run(config)
    found = records(tmp_path / "out")
    start, *_, last = [r for r in found if "eval_loss" in r]
    assert start["step"] == 0 and last["step"] == 6
    for record in (start, last):
        assert 0.0 <= record["eval_reward_accuracy"] <= 1.0 and math.isfinite(record["eval_reward_margin"])
    # the rejected answers all end with " no": an easy preference the reward model learns
    assert last["eval_loss"] < start["eval_loss"] and last["eval_reward_margin"] > start["eval_reward_margin"]
    assert summary["preference"]["objective"] == "reward"
    assert any(
        line.startswith("reward head: Qwen3ForSequenceClassification.score") for line in summary["policies"]
    )
    saved = json.loads((tmp_path / "out" / "adapter" / "adapter_config.json").read_text())
    assert saved["task_type"] == "SEQ_CLS" and "score" in (saved["modules_to_save"] or [])


def test_a_margin_column_moves_the_loss_by_it(tmp_path):
    rows = pair_rows(8)
    plain = reward_config(tmp_path, rows, out="plain", training={"steps": 1})
    run(plain)
    with_margin = reward_config(
        tmp_path, [{**row, "margin": 1.5} for row in rows], out="margin", training={"steps": 1}
    )
    run(with_margin)
    [first], [shifted] = records(tmp_path / "plain"), records(tmp_path / "margin")
    # the same scores at step 1: -log sigmoid(d - 1.5) > -log sigmoid(d) for every pair
    assert shifted["reward_margin"] == pytest.approx(first["reward_margin"], abs=1e-6)
    assert shifted["loss"] > first["loss"] + 0.5


def test_a_center_coefficient_adds_its_term(tmp_path):
    rows = pair_rows(8)
    run(reward_config(tmp_path, rows, out="plain", training={"steps": 1}))
    run(
        reward_config(
            tmp_path, rows, out="center", training={"steps": 1}, reward={"center_rewards_coefficient": 0.5}
        )
    )
    [plain], [center] = records(tmp_path / "plain"), records(tmp_path / "center")
    mean_square = (plain["chosen_reward"] + plain["rejected_reward"]) ** 2  # a lower bound of the mean
    assert center["loss"] >= plain["loss"] + 0.5 * mean_square - 1e-6


BAD_ROWS = [
    ({"margin": "big"}, "'margin' must be a finite number"),
    ({"margin": True}, "'margin' must be a finite number"),
    ({"chosen": "word " * 200}, "past data.max_seq_len 128; a reward model scores each answer's last token"),
]


@pytest.mark.parametrize("change, message", BAD_ROWS, ids=["string", "bool", "too-long"])
def test_a_bad_reward_row_is_one_line_naming_file_and_line(tmp_path, capsys, change, message):
    rows = pair_rows(6)
    rows[2] = {**rows[2], **change}
    config = reward_config(tmp_path, rows)
    capsys.readouterr()
    assert main(["train", str(config)]) != 0
    err = capsys.readouterr().err
    assert "pairs.jsonl:3: " in err and message in err and "Traceback" not in err, err
    assert not (tmp_path / "out" / "run.json").exists()


def test_margins_on_some_rows_only_are_refused(tmp_path):
    rows = pair_rows(6)
    rows[1] = {**rows[1], "margin": 0.5}
    with pytest.raises(Exception, match=r"1 of 6 pairs give 'margin': give it on every row or on none"):
        run(reward_config(tmp_path, rows))


REFUSALS = [
    ({"data": {"share_prefixes": "tree"}}, "data.share_prefixes"),
    ({"quantization": {"four_bit": True}}, "quantization.four_bit"),
]


@pytest.mark.parametrize("sections, key", REFUSALS, ids=[key for _, key in REFUSALS])
def test_what_the_reward_model_cannot_do_is_refused_by_key(tmp_path, sections, key):
    config = reward_config(tmp_path, **sections)
    with pytest.raises(ConfigError) as caught:
        load_config(config)
    message = str(caught.value)
    assert key in message and "reward" in message and message.startswith(str(config)), message


# ----------------------------------------------------------------------------- export, then GRPO's reward


def test_the_exported_reward_model_scores_alike_in_grpo_rewards_and_trls_grpo_trainer(tmp_path):
    pytest.importorskip("trl")
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from slipstream.export.merged import export_merged
    from slipstream.models import build_model as build
    from slipstream.rewards import load_rewards, score

    config = reward_config(tmp_path, training={"steps": 2}, optimizer={"lr": 3e-2})
    run(config)
    report = export_merged(tmp_path / "out", tmp_path / "rm")
    assert report.check.ok and report.check.kind == "score"  # one score a probe row, said as such
    assert report.check.probed.endswith("sequences' scores") and "vocabulary" not in report.check.describe()
    saved = json.loads((tmp_path / "rm" / "config.json").read_text())
    assert saved["architectures"] == ["Qwen3ForSequenceClassification"] and saved["pad_token_id"] is not None
    prompts = ["Question 1: the river runs north?", "Question 2: old mills?", "Question 3: quiet towns?"]
    completions = [" grey hills no", " farmers grow wheat", " the"]
    [function] = load_rewards([str(tmp_path / "rm")], base=tmp_path)
    ours = [row[0] for row in score([function], prompts, completions, [[1]] * 3, {})]

    policy = tmp_path / "policy"  # any causal LM: GRPOTrainer needs a policy to be built
    build("qwen3", vocab_size=saved["vocab_size"]).save_pretrained(policy)
    args = GRPOConfig(
        output_dir=str(tmp_path / "grpo"),
        report_to="none",
        use_cpu=True,
        num_generations=3,
        per_device_train_batch_size=3,
        bf16=False,
    )
    trainer = GRPOTrainer(
        model=str(policy),
        reward_funcs=str(tmp_path / "rm"),
        args=args,
        train_dataset=Dataset.from_list([{"prompt": p} for p in prompts]),
        processing_class=AutoTokenizer.from_pretrained(tmp_path / "rm"),
    )
    inputs = [{"prompt": p} for p in prompts]
    theirs = trainer._calculate_rewards(inputs, prompts, completions, [[1]] * 3)[:, 0].tolist()
    assert ours == pytest.approx(theirs, rel=1e-6, abs=1e-7)
    assert len(set(ours)) == 3  # three different scores: the head reads each row, not one


def test_a_reward_run_neither_generates_nor_goes_to_gguf(tmp_path):
    from slipstream.export.gguf_export import export_gguf
    from slipstream.export.merged import ExportError
    from slipstream.generation import GenerateError, load_generator

    run(reward_config(tmp_path, training={"steps": 1}))
    with pytest.raises(GenerateError, match="a reward model's run .*it does not generate"):
        load_generator(tmp_path / "out")
    pytest.importorskip("gguf")
    with pytest.raises(ExportError, match="a reward model's run .*--gguf writes a causal LM"):
        export_gguf(tmp_path / "out", tmp_path / "rm.gguf")
    assert not (tmp_path / "rm.gguf").exists()
