"""ORPO: the packed loss against a direct per-pair computation with a stock Hugging Face forward
(each answer alone after its prompt, fp32), and a short ``slipstream train`` run."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from slipstream.models import build_model
from slipstream.objectives import objective_for
from slipstream.objectives.pairs import PairSettings
from slipstream.optimize import optimize, state_of
from slipstream.speedups import Speedups
from tests.objectives.test_pairs import dpo_config, records, run, write_pairs

VOCAB, BETA = 96, 0.25
PAIRS = [
    {"prompt_ids": [5, 9, 14, 3, 22, 7], "chosen_ids": [31, 8, 17], "rejected_ids": [40, 41, 2, 9, 11]},
    {"prompt_ids": [12, 6, 6, 50], "chosen_ids": [70, 71, 72, 73], "rejected_ids": [19, 2]},
    {"prompt_ids": [88, 1, 2, 3, 4, 5, 6], "chosen_ids": [9], "rejected_ids": [10, 11, 12]},
]


def _mean_logprob(model, prompt, answer) -> torch.Tensor:
    """The answer's mean per-token log-prob, run alone after its prompt (stock forward, logits)."""
    ids = torch.tensor([prompt + answer])
    logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
    return F.log_softmax(logits, -1).gather(-1, torch.tensor(answer)[:, None]).mean()


def _direct(model) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Mean loss, NLL and log-odds over the pairs, as the paper (and TRL, per pair) writes them."""
    losses, nlls, odds = [], [], []
    for pair in PAIRS:
        chosen = _mean_logprob(model, pair["prompt_ids"], pair["chosen_ids"])
        rejected = _mean_logprob(model, pair["prompt_ids"], pair["rejected_ids"])
        log_odds = (chosen - rejected) - (torch.log1p(-torch.exp(chosen)) - torch.log1p(-torch.exp(rejected)))
        losses.append(-chosen - BETA * F.logsigmoid(log_odds))
        nlls.append(-chosen)
        odds.append(log_odds)
    return torch.stack(losses).mean(), torch.stack(nlls).mean(), torch.stack(odds).mean()


def test_the_packed_orpo_loss_matches_a_stock_forward_per_pair():
    stock = build_model("llama", vocab_size=VOCAB, seed=1, dtype=torch.float32).eval()
    expected_loss, expected_nll, expected_odds = _direct(stock)
    for prefix_sharing in (True, False):
        model = build_model("llama", vocab_size=VOCAB, seed=1, dtype=torch.float32).eval()
        optimize(model, Speedups())
        objective = objective_for("orpo")(None, PairSettings(beta=BETA, prefix_sharing=prefix_sharing))
        objective.chunked = state_of(model).chunked_loss is not None
        micro = objective.collate(PAIRS, "cpu")
        loss, sums = objective.micro_batch(model, micro, len(PAIRS))
        metrics = dict(zip(objective.metrics, (sums / len(PAIRS)).tolist(), strict=True))
        torch.testing.assert_close(loss, expected_loss, atol=1e-5, rtol=1e-5)
        assert metrics["loss"] == _approx(expected_loss)
        assert metrics["nll"] == _approx(expected_nll) and metrics["log_odds"] == _approx(expected_odds)
        loss.backward()  # differentiable through the packed pairs
        assert all(p.grad is None or torch.isfinite(p.grad).all() for p in model.parameters())


def _approx(value: torch.Tensor):
    return pytest.approx(value.item(), rel=1e-5, abs=1e-5)


def test_orpo_trains_reference_free_and_logs_its_nll_and_log_odds(tmp_path):
    pairs = write_pairs(tmp_path)
    _, summary = run(dpo_config(tmp_path, pairs, training={"objective": "orpo", "steps": 2}))
    found = records(tmp_path / "out")
    assert len(found) == 2 and all(math.isfinite(r["loss"]) for r in found)
    for name in ("chosen_reward", "rejected_reward", "reward_margin", "reward_accuracy", "nll", "log_odds"):
        assert name in found[0], found[0]
    # loss = nll - beta * log sigmoid(log_odds), averaged over pairs: at step 1 within rounding
    first = found[0]
    assert first["loss"] >= first["nll"]  # -beta * log sigmoid(.) > 0
    preference = summary["preference"]
    assert preference["objective"] == "orpo" and preference["reference"] == "none"
    assert not any("reference log-probs" in line for line in summary["policies"])
