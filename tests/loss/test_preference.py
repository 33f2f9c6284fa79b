"""The preference losses against their formulas, written out by hand."""

from __future__ import annotations

import math

import pytest
import torch

from slipstream.loss.preference import METRICS, dpo_terms, ipo_terms, metric_sums, simpo_terms

LN2 = math.log(2.0)


def softplus(x: float) -> float:  # -log sigmoid(-x)
    return math.log1p(math.exp(x))


def nls(x: float) -> float:  # -log sigmoid(x)
    return softplus(-x)


# two pairs: [chosen0, rejected0, chosen1, rejected1]
POLICY = torch.tensor([-10.0, -14.0, -30.0, -21.0])
REFERENCE = torch.tensor([-11.0, -12.0, -29.0, -24.0])
LENGTHS = torch.tensor([4.0, 7.0, 10.0, 3.0])


def test_dpo_loss_and_rewards():
    beta = 0.1
    terms = dpo_terms(POLICY, REFERENCE, LENGTHS, beta)
    # pair 0: chosen ratio +1, rejected ratio -2 -> margin 3; pair 1: chosen -1, rejected +3 -> -4
    assert terms.losses.tolist() == pytest.approx([nls(0.1 * 3), nls(0.1 * -4)], abs=1e-6)
    assert terms.chosen_rewards.tolist() == pytest.approx([0.1, -0.1], abs=1e-6)
    assert terms.rejected_rewards.tolist() == pytest.approx([-0.2, 0.3], abs=1e-6)


def test_dpo_with_the_policy_at_the_reference_is_ln2_and_rewards_zero():
    policy = torch.tensor([-3.5, -8.25, -1.0, -40.0])
    terms = dpo_terms(policy, policy.clone(), LENGTHS, beta=0.5)
    assert terms.losses.tolist() == pytest.approx([LN2, LN2], abs=1e-7)
    assert terms.chosen_rewards.abs().max().item() == 0
    assert terms.rejected_rewards.abs().max().item() == 0
    sums = metric_sums(terms)
    metrics = dict(zip(METRICS, (sums / 2).tolist(), strict=True))
    assert metrics["loss"] == pytest.approx(LN2) and metrics["reward_margin"] == 0
    assert metrics["reward_accuracy"] == 0  # a tie is not a win


def test_ipo_uses_per_token_means():
    beta = 0.25
    terms = ipo_terms(POLICY, REFERENCE, LENGTHS, beta)
    mean = (POLICY / LENGTHS).tolist()
    ref = (REFERENCE / LENGTHS).tolist()
    expected, chosen, rejected = [], [], []
    for i in range(2):
        c, r = mean[2 * i] - ref[2 * i], mean[2 * i + 1] - ref[2 * i + 1]
        expected.append((c - r - 1 / (2 * beta)) ** 2)
        chosen.append(beta * c)
        rejected.append(beta * r)
    assert terms.losses.tolist() == pytest.approx(expected, rel=1e-6)
    assert terms.chosen_rewards.tolist() == pytest.approx(chosen, rel=1e-6)
    assert terms.rejected_rewards.tolist() == pytest.approx(rejected, rel=1e-6)
    # by hand, pair 0: (1/4 - (-2)/7 - 2)^2
    assert terms.losses[0].item() == pytest.approx((0.25 + 2 / 7 - 2.0) ** 2, rel=1e-6)
    # sums (not means) would give another number
    summed = (1.0 - (-2.0) - 2.0) ** 2
    assert abs(terms.losses[0].item() - summed) > 0.1


def test_ipo_at_the_reference_is_one_over_two_beta_squared():
    terms = ipo_terms(POLICY, POLICY.clone(), LENGTHS, beta=0.1)
    assert terms.losses.tolist() == pytest.approx([25.0, 25.0], rel=1e-6)


def test_simpo_is_reference_free_on_per_token_means():
    beta, gamma = 2.0, 0.5
    terms = simpo_terms(POLICY, LENGTHS, beta, gamma)
    a = (POLICY / LENGTHS).tolist()  # -2.5, -2, -3, -7
    assert terms.losses.tolist() == pytest.approx(
        [nls(beta * (a[0] - a[1]) - gamma), nls(beta * (a[2] - a[3]) - gamma)], rel=1e-6
    )
    assert terms.losses[0].item() == pytest.approx(nls(2.0 * -0.5 - 0.5), rel=1e-6)
    assert terms.chosen_rewards.tolist() == pytest.approx([beta * a[0], beta * a[2]], rel=1e-6)
    assert terms.rejected_rewards.tolist() == pytest.approx([beta * a[1], beta * a[3]], rel=1e-6)


def test_gradients_flow_to_the_policy_only_and_rewards_are_detached():
    policy = POLICY.clone().requires_grad_(True)
    terms = dpo_terms(policy, REFERENCE, LENGTHS, beta=0.1)
    assert not terms.chosen_rewards.requires_grad and not terms.rejected_rewards.requires_grad
    terms.losses.sum().backward()
    # d/d s_c of -log sigmoid(beta * m) = -beta * sigmoid(-beta * m); the rejected one the opposite
    margins = [3.0, -4.0]
    expected = []
    for m in margins:
        g = -0.1 / (1 + math.exp(0.1 * m))
        expected += [g, -g]
    assert policy.grad.tolist() == pytest.approx(expected, rel=1e-5)


def test_metric_sums_stack_the_metrics_in_order():
    terms = dpo_terms(POLICY, REFERENCE, LENGTHS, beta=0.1)
    sums = metric_sums(terms).tolist()
    assert METRICS == ("loss", "chosen_reward", "rejected_reward", "reward_margin", "reward_accuracy")
    assert sums[0] == pytest.approx(nls(0.3) + nls(-0.4), rel=1e-6)
    assert sums[1] == pytest.approx(0.0, abs=1e-6) and sums[2] == pytest.approx(0.1, abs=1e-6)
    assert sums[3] == pytest.approx(0.3 - 0.4, abs=1e-6)
    assert sums[4] == 1.0  # pair 0 prefers its chosen answer, pair 1 does not


def test_refusals():
    with pytest.raises(ValueError, match="the dpo loss needs the reference"):
        dpo_terms(POLICY, None, LENGTHS, 0.1)
    with pytest.raises(ValueError, match="the ipo loss needs the reference"):
        ipo_terms(POLICY, None, LENGTHS, 0.1)
