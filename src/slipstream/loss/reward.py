"""The reward model's loss (Bradley-Terry), as TRL's ``RewardTrainer.compute_loss`` computes it.

With ``r_c`` / ``r_r`` the scalar scores of prompt + chosen and prompt + rejected:

    loss = -log sigmoid(r_c - r_r - margin) + center * (r_c + r_r)^2

averaged over pairs (TRL: ``.mean()`` over the batch's pairs, then ``center_rewards_coefficient *
mean((r_c + r_r)^2)`` added: the same per-pair sum). ``margin`` is the row's optional column (0 where
there is none); ``center`` pulls the rewards towards zero mean (Eisenstein et al. 2023), off by default.
Rewards are the scores themselves, so the pair metrics (margin, accuracy) are TRL's ``margin`` and
``accuracy``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .preference import PairTerms


def reward_terms(
    scores: torch.Tensor, margins: torch.Tensor | None = None, center: float | None = None
) -> PairTerms:
    """``scores``: [2 x pairs] fp32, chosen at even, rejected at odd indices; ``margins``: [pairs] or None."""
    chosen, rejected = scores[0::2], scores[1::2]
    difference = chosen - rejected
    if margins is not None:
        difference = difference - margins.to(difference)
    losses = -F.logsigmoid(difference)
    if center:
        losses = losses + center * (chosen + rejected) ** 2
    return PairTerms(losses, chosen.detach(), rejected.detach())
