"""The KTO losses (Ethayarajh et al. 2024), as TRL 1.16's ``KTOTrainer._compute_loss`` computes them.

From each row's summed completion log-prob ``s`` (policy) and ``s^ref`` (reference), its label
(desirable or not) and the micro-batch's KL baseline ``kl``:

- ``kto``: desirable ``1 - sigmoid(beta * ((s - s^ref) - kl))``, undesirable
  ``1 - sigmoid(beta * (kl - (s - s^ref)))``;
- ``apo_zero_unpaired`` (D'Oosterlinck et al. 2024, unpaired): desirable ``1 - sigmoid(beta * (s - s^ref))``,
  undesirable ``sigmoid(beta * (s - s^ref))`` (no KL baseline).

Each loss is multiplied by ``desirable_weight`` / ``undesirable_weight``; rewards are ``beta * (s - s^ref)``.
``kl`` is :func:`kl_baseline`: the mean over the micro-batch of the policy's minus the reference's
log-probs of mismatched completions (prompt i with another row's completion), detached, clamped at 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

KTO_LOSS_TYPES = ("kto", "apo_zero_unpaired")


@dataclass(frozen=True)
class KTOTerms:
    """Per-row weighted losses and rewards, [rows] each (fp32), in the rows' order."""

    losses: torch.Tensor
    rewards: torch.Tensor  # beta * (s - s^ref), detached


def kl_baseline(kl_policy: torch.Tensor, kl_reference: torch.Tensor) -> torch.Tensor:
    """The micro-batch's mean of ``kl_policy - kl_reference`` ([rows] summed log-probs of the mismatched
    completions), detached, before the ranks' mean and the clamp (:func:`clamp_kl`)."""
    return (kl_policy - kl_reference).mean().detach()


def clamp_kl(kl: torch.Tensor) -> torch.Tensor:
    """TRL clamps the (gathered) baseline at 0: a KL divergence estimate is never negative."""
    return kl.clamp(min=0)


def kto_terms(
    policy: torch.Tensor,
    reference: torch.Tensor,
    desirable: torch.Tensor,
    kl: torch.Tensor | float,
    *,
    beta: float,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
    loss_type: str = "kto",
) -> KTOTerms:
    """``policy`` / ``reference``: [rows] summed completion log-probs; ``desirable``: [rows] bool labels;
    ``kl``: the baseline (ignored by ``apo_zero_unpaired``). Per row, its weighted loss and its reward."""
    ratio = policy - reference.to(policy.dtype)
    if loss_type == "kto":
        desired = 1 - torch.sigmoid(beta * (ratio - kl))
        undesired = 1 - torch.sigmoid(beta * (kl - ratio))
    elif loss_type == "apo_zero_unpaired":
        desired = 1 - torch.sigmoid(beta * ratio)
        undesired = torch.sigmoid(beta * ratio)
    else:
        raise ValueError(f"unknown KTO loss_type {loss_type!r} (expected one of {', '.join(KTO_LOSS_TYPES)})")
    losses = torch.where(desirable, desirable_weight * desired, undesirable_weight * undesired)
    return KTOTerms(losses, beta * ratio.detach())


# the metrics of a KTO step and evaluation, in the order ``kto_metric_sums`` stacks them
KTO_METRICS = ("loss", "chosen_reward", "rejected_reward", "reward_margin", "kl", "desirable")


def kto_metric_sums(terms: KTOTerms, desirable: torch.Tensor, kl: torch.Tensor | float) -> torch.Tensor:
    """[len(KTO_METRICS)] sums over the rows (divided by the step's rows, then :func:`kto_means`): the
    losses, the desirable and undesirable rows' rewards, a zero margin slot (a difference of means), the
    baseline once per row (its row-weighted mean over the micro-batches) and the desirable rows."""
    wanted = desirable.to(terms.rewards.dtype)
    kl = torch.as_tensor(kl, dtype=terms.rewards.dtype, device=terms.rewards.device).reshape(())
    return torch.stack(
        [
            terms.losses.detach().sum(),
            (terms.rewards * wanted).sum(),
            (terms.rewards * (1 - wanted)).sum(),
            torch.zeros_like(kl),
            kl * wanted.numel(),
            wanted.sum(),
        ]
    )


def kto_means(per_row: dict[str, float]) -> dict[str, float]:
    """:func:`kto_metric_sums` over the rows as TRL logs them: the rewards as means over the desirable
    (undesirable) rows, NaN where there are none, and their margin; the rest per row."""
    share = per_row["desirable"]
    chosen = per_row["chosen_reward"] / share if share > 0 else math.nan
    rejected = per_row["rejected_reward"] / (1 - share) if share < 1 else math.nan
    return {
        **per_row,
        "chosen_reward": chosen,
        "rejected_reward": rejected,
        "reward_margin": chosen - rejected,
    }
