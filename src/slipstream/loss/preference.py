"""The preference losses, from each pair's summed answer log-probs (policy and reference).

With ``s`` a summed log-prob and ``a`` its per-token mean (``s / answer tokens``):

- ``dpo`` (Rafailov et al. 2023, "sigmoid"): ``-log sigmoid(beta * ((s_c - s_c^ref) - (s_r - s_r^ref)))``;
  rewards ``beta * (s - s^ref)``.
- ``ipo`` (Azar et al. 2023): ``(((a_c - a_c^ref) - (a_r - a_r^ref)) - 1 / (2 beta))^2`` on per-token means,
  as TRL computes it; rewards ``beta * (a - a^ref)``.
- ``simpo`` (Meng et al. 2024, reference-free): ``-log sigmoid(beta * (a_c - a_r) - gamma)``; rewards ``beta * a``.
- ``orpo`` (Hong et al. 2024, reference-free): ``-a_c - beta * log sigmoid(log_odds)``, see :func:`orpo_terms`.

Every one returns per-pair losses and rewards; the step averages over the step's pairs, so a
pair weighs the same whichever micro-batch it was packed into.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class PairTerms:
    """Per-pair losses and rewards, [pairs] each (fp32); ``extra``: further per-pair values an
    objective reports (ORPO: its NLL and log-odds), detached."""

    losses: torch.Tensor
    chosen_rewards: torch.Tensor
    rejected_rewards: torch.Tensor
    extra: tuple[torch.Tensor, ...] = ()


def _ratios(policy: torch.Tensor, reference: torch.Tensor | None, name: str):
    if reference is None:
        raise ValueError(f"the {name} loss needs the reference log-probs")
    return policy[0::2] - reference[0::2], policy[1::2] - reference[1::2]


def dpo_terms(policy, reference, lengths, beta: float) -> PairTerms:
    """``policy`` / ``reference``: [2 x pairs] summed log-probs, chosen at even, rejected at odd
    indices; ``lengths``: the answers' token counts (same layout)."""
    chosen_ratio, rejected_ratio = _ratios(policy, reference, "dpo")
    losses = -F.logsigmoid(beta * (chosen_ratio - rejected_ratio))
    return PairTerms(losses, beta * chosen_ratio.detach(), beta * rejected_ratio.detach())


def ipo_terms(policy, reference, lengths, beta: float) -> PairTerms:
    if reference is None:
        raise ValueError("the ipo loss needs the reference log-probs")
    chosen_ratio, rejected_ratio = _ratios(policy / lengths, reference / lengths, "ipo")
    losses = ((chosen_ratio - rejected_ratio) - 1.0 / (2.0 * beta)) ** 2
    return PairTerms(losses, beta * chosen_ratio.detach(), beta * rejected_ratio.detach())


def simpo_terms(policy, lengths, beta: float, gamma: float) -> PairTerms:
    means = policy / lengths
    chosen, rejected = means[0::2], means[1::2]
    losses = -F.logsigmoid(beta * (chosen - rejected) - gamma)
    return PairTerms(losses, beta * chosen.detach(), beta * rejected.detach())


def log1m_exp(x: torch.Tensor) -> torch.Tensor:
    """``log(1 - exp(x))`` for ``x <= 0``, stable at both ends (Maechler 2012)."""
    return torch.where(x > -0.6931471805599453, torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


def orpo_terms(policy, lengths, beta: float) -> PairTerms:
    """ORPO (Hong et al. 2024, as TRL's ORPOTrainer computes it) on per-token means ``a``: the chosen
    answer's NLL ``-a_c`` minus ``beta * log sigmoid(log_odds)``, ``log_odds = (a_c - a_r) -
    (log(1 - exp(a_c)) - log(1 - exp(a_r)))``; rewards ``beta * a``; extra: (NLL, log-odds)."""
    means = policy / lengths
    chosen, rejected = means[0::2], means[1::2]
    log_odds = (chosen - rejected) - (log1m_exp(chosen) - log1m_exp(rejected))
    nll = -chosen
    losses = nll - beta * F.logsigmoid(log_odds)
    return PairTerms(
        losses, beta * chosen.detach(), beta * rejected.detach(), (nll.detach(), log_odds.detach())
    )


# The metrics every step and evaluation reports, in the order ``metric_sums`` stacks them.
METRICS = ("loss", "chosen_reward", "rejected_reward", "reward_margin", "reward_accuracy")


def metric_sums(terms: PairTerms) -> torch.Tensor:
    """[len(METRICS)] sums over the pairs (divided by the pair count once, after every micro-batch)."""
    margin = terms.chosen_rewards - terms.rejected_rewards
    return torch.stack(
        [
            terms.losses.detach().sum(),
            terms.chosen_rewards.sum(),
            terms.rejected_rewards.sum(),
            margin.sum(),
            (margin > 0).float().sum(),
            *(value.sum() for value in terms.extra),
        ]
    )
