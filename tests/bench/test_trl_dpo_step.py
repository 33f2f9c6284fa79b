"""The TRL DPO arm: TRL's DPOTrainer step, checked against a DPO loss computed by hand in plain torch."""

import math

import pytest

pytest.importorskip("trl")
peft = pytest.importorskip("peft")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast  # noqa: E402

from slipstream.bench.peers.trl_dpo_step import TrlDpoStep  # noqa: E402

VOCAB, PAD, EOS, BETA = 128, 0, 1, 0.1


def _tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer over the tiny model's whole vocabulary: pad 0, EOS 1."""
    vocab = {"<pad>": PAD, "<eos>": EOS, **{f"t{i}": i for i in range(2, VOCAB)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>")


def _model():
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=128,
        pad_token_id=PAD,
        eos_token_id=EOS,
        bos_token_id=None,
    )
    base = LlamaForCausalLM(config).float()
    lora = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"])
    return peft.get_peft_model(base, lora)


def _pairs() -> list[dict]:
    generator = torch.Generator().manual_seed(1)

    def tokens(n):
        return torch.randint(2, VOCAB, (n,), generator=generator).tolist()

    lengths = [(5, 3, 6), (2, 7, 2), (8, 4, 4), (3, 1, 9)]  # prompt, chosen, rejected (before EOS)
    return [
        {"prompt_ids": tokens(p), "chosen_ids": tokens(c) + [EOS], "rejected_ids": tokens(r) + [EOS]}
        for p, c, r in lengths
    ]


@torch.no_grad()
def _answer_logps(model, pairs) -> tuple[torch.Tensor, torch.Tensor]:
    """Each answer's summed log-probability given its prompt, one unpadded sequence at a time."""

    def logp(prompt, answer):
        ids = torch.tensor([prompt + answer])
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1]
        return logits.log_softmax(-1).gather(-1, torch.tensor(answer)[:, None]).sum()

    model.eval()
    chosen = torch.stack([logp(p["prompt_ids"], p["chosen_ids"]) for p in pairs])
    rejected = torch.stack([logp(p["prompt_ids"], p["rejected_ids"]) for p in pairs])
    return chosen, rejected


def _arm(model, **overrides) -> TrlDpoStep:
    options = dict(steps=3, lr=1e-2, schedule="linear", warmup_steps=0, seed=0, beta=BETA)
    return TrlDpoStep(model, _tokenizer(), **{**options, **overrides})


@pytest.mark.parametrize("split", [[4], [3, 1]], ids=["one micro-batch", "unequal micro-batches"])
def test_trl_dpo_step_matches_a_dpo_loss_computed_by_hand(split):
    model = _model()
    pairs = _pairs()
    arm = _arm(model, grad_accum=len(split))
    try:
        assert any("TRL DPOTrainer" in line for line in arm.policies)
        batches, start = [], 0
        for size in split:
            batches.append(arm.collate(pairs[start : start + size]))
            start += size
        assert [count for _, count in batches] == split
        inputs = batches[0][0]
        # TRL's collator: chosen rows, then rejected rows, right-padded with the pad token
        assert inputs["input_ids"].shape[0] == 2 * split[0]
        assert {"input_ids", "attention_mask", "completion_mask"} <= set(inputs)

        ref_chosen, ref_rejected = _answer_logps(model, pairs)  # the policy before any update

        first = arm(batches)
        # policy == reference before the first update: every DPO logit is 0
        assert abs(first["loss"] - math.log(2)) < 1e-5
        assert first["lr"] == pytest.approx(1e-2)
        assert first["reward_margin"] == pytest.approx(0.0, abs=1e-6) and first["accuracy"] == 0.0
        assert first["grad_norm"] > 0

        policy_chosen, policy_rejected = _answer_logps(model, pairs)
        with model.disable_adapter():
            base_chosen, base_rejected = _answer_logps(model, pairs)
        # the reference TRL uses is the model before the update, i.e. the base
        torch.testing.assert_close(base_chosen, ref_chosen, rtol=0, atol=1e-5)
        torch.testing.assert_close(base_rejected, ref_rejected, rtol=0, atol=1e-5)
        chosen_rewards = BETA * (policy_chosen - base_chosen)
        rejected_rewards = BETA * (policy_rejected - base_rejected)
        by_hand = -F.logsigmoid(chosen_rewards - rejected_rewards).mean().item()

        second = arm(batches)
        assert abs(second["loss"] - math.log(2)) > 1e-4  # the first update moved the policy
        assert abs(second["loss"] - by_hand) < 1e-4
        assert second["chosen_reward"] == pytest.approx(chosen_rewards.mean().item(), abs=1e-4)
        assert second["rejected_reward"] == pytest.approx(rejected_rewards.mean().item(), abs=1e-4)
        margin = (chosen_rewards - rejected_rewards).mean().item()
        assert second["reward_margin"] == pytest.approx(margin, abs=1e-4)
        for result in (first, second):
            for key in ("loss", "grad_norm", "reward_margin", "chosen_reward", "rejected_reward"):
                assert math.isfinite(result[key])
            assert 0.0 <= result["accuracy"] <= 1.0
            assert result["forward_s"] > 0 and result["backward_s"] > 0
    finally:
        arm.close()
