"""The reward model's loss against TRL's own ``RewardTrainer.compute_loss`` on the same scores."""

from __future__ import annotations

import types

import pytest
import torch

from slipstream.loss.reward import reward_terms
from slipstream.models import build_model

trl = pytest.importorskip("trl")


@pytest.fixture(scope="module")
def trainer(tmp_path_factory):
    """A real RewardTrainer (a tiny sequence classifier), whose compute_loss the tests call."""
    from datasets import Dataset
    from trl import RewardConfig, RewardTrainer

    from slipstream.data.demo_bpe import demo_tokenizer

    tokenizer = demo_tokenizer()
    model = build_model("llama", vocab_size=len(tokenizer), head="reward")
    args = RewardConfig(
        output_dir=str(tmp_path_factory.mktemp("trl")), report_to="none", use_cpu=True, max_length=None
    )
    rows = Dataset.from_list([{"prompt": "a", "chosen": " b", "rejected": " c"}])
    return RewardTrainer(model=model, args=args, train_dataset=rows, processing_class=tokenizer)


def _trl_loss(trainer, scores: torch.Tensor, margins: torch.Tensor | None, center: float | None) -> float:
    """TRL's compute_loss on a model whose forward returns ``scores`` (chosen rows first, as its collator)."""
    pairs = scores.numel() // 2
    chosen_first = torch.cat([scores[0::2], scores[1::2]])[:, None]
    model = types.SimpleNamespace(training=True)
    fake = lambda **inputs: types.SimpleNamespace(logits=chosen_first)  # noqa: E731
    inputs = {"input_ids": torch.zeros(2 * pairs, 3, dtype=torch.long)}
    inputs["attention_mask"] = torch.ones_like(inputs["input_ids"])
    if margins is not None:
        inputs["margin"] = margins
    trainer.args.center_rewards_coefficient = center
    saved, trainer.model = trainer.model, model
    try:
        return float(trainer.compute_loss(fake, inputs))
    finally:
        trainer.model = saved


@pytest.mark.parametrize("margin", [False, True])
@pytest.mark.parametrize("center", [None, 0.01])
def test_the_reward_loss_is_trls_on_the_same_scores(trainer, margin, center):
    generator = torch.Generator().manual_seed(3)
    scores = torch.randn(10, generator=generator) * 2  # 5 pairs: chosen at even, rejected at odd indices
    margins = torch.rand(5, generator=generator) if margin else None
    ours = reward_terms(scores, margins, center).losses.mean().item()
    assert ours == pytest.approx(_trl_loss(trainer, scores, margins, center), rel=1e-6, abs=1e-7)


def test_the_margin_and_accuracy_are_trls():
    scores = torch.tensor([2.0, 1.0, -1.0, 0.5, 3.0, 3.5])
    terms = reward_terms(scores)
    margin = terms.chosen_rewards - terms.rejected_rewards
    assert margin.mean().item() == pytest.approx((1.0 - 1.5 - 0.5) / 3)
    assert (margin > 0).float().mean().item() == pytest.approx(1 / 3)
