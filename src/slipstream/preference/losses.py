"""The preference losses, from each pair's summed answer log-probs (policy and reference).

With ``s`` a summed log-prob and ``a`` its per-token mean (``s / answer tokens``):

- ``dpo`` (Rafailov et al. 2023, "sigmoid"): ``-log sigmoid(beta * ((s_c - s_c^ref) - (s_r - s_r^ref)))``;
  rewards ``beta * (s - s^ref)``.
- ``ipo`` (Azar et al. 2023): ``(((a_c - a_c^ref) - (a_r - a_r^ref)) - 1 / (2 beta))^2`` on per-token means,
  as TRL computes it; rewards ``beta * (a - a^ref)``.
- ``simpo`` (Meng et al. 2024, reference-free): ``-log sigmoid(beta * (a_c - a_r) - gamma)``; rewards ``beta * a``.

Every one returns per-pair losses and rewards; the step averages over the step's pairs, so a
pair weighs the same whichever micro-batch it was packed into.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

PreferenceLossName = Literal["dpo", "ipo", "simpo"]
REFERENCE_FREE = frozenset({"simpo"})


@dataclass(frozen=True)
class PairTerms:
    """Per-pair losses and rewards, [pairs] each (fp32)."""

    losses: torch.Tensor
    chosen_rewards: torch.Tensor
    rejected_rewards: torch.Tensor


def preference_terms(
    name: str,
    policy: torch.Tensor,
    reference: torch.Tensor | None,
    lengths: torch.Tensor,
    beta: float,
    simpo_gamma: float = 1.0,
) -> PairTerms:
    """``policy`` / ``reference``: [2 x pairs] summed log-probs, chosen at even, rejected at odd
    indices; ``lengths``: the answers' token counts (same layout)."""
    if name in REFERENCE_FREE:
        reference = None
    elif reference is None:
        raise ValueError(f"the {name} loss needs the reference log-probs")
    if name in ("ipo", "simpo"):  # per-token means
        policy = policy / lengths
        reference = None if reference is None else reference / lengths
    chosen, rejected = policy[0::2], policy[1::2]
    if reference is not None:
        chosen_ratio, rejected_ratio = chosen - reference[0::2], rejected - reference[1::2]
    if name == "dpo":
        losses = -F.logsigmoid(beta * (chosen_ratio - rejected_ratio))
        return PairTerms(losses, beta * chosen_ratio.detach(), beta * rejected_ratio.detach())
    if name == "ipo":
        losses = ((chosen_ratio - rejected_ratio) - 1.0 / (2.0 * beta)) ** 2
        return PairTerms(losses, beta * chosen_ratio.detach(), beta * rejected_ratio.detach())
    if name == "simpo":
        losses = -F.logsigmoid(beta * (chosen - rejected) - simpo_gamma)
        return PairTerms(losses, beta * chosen.detach(), beta * rejected.detach())
    raise ValueError(f"unknown preference loss {name!r} (expected dpo, ipo or simpo)")


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
        ]
    )
