"""GRPO's update loss from per-token log-probs: the clipped surrogate, the KL to the reference, and the
aggregation over tokens (a pure function of tensors; ``objectives.grpo`` feeds it a micro-batch).

Per token, with ratio ``r = exp(logp - logp_old)``::

    loss_t = -min(r * A, clip(r, 1 - epsilon, 1 + epsilon_high) * A) + beta * KL_t
    KL_t   = exp(ref_t - logp_t) - (ref_t - logp_t) - 1            (k3, the reference's)

``aggregate``: ``dapo`` and ``dr_grpo`` sum the counted tokens (``mask``), ``grpo`` takes each
completion's token mean first; the caller's ``weight`` (:func:`loss_divisor`, over the whole step)
divides either, so the micro-batches' losses add up to the step's.
"""

from __future__ import annotations

from typing import Literal

import torch

Aggregate = Literal["dapo", "grpo", "dr_grpo"]


def policy_loss(
    logp: torch.Tensor,
    old: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    weight: float,
    *,
    epsilon: float,
    epsilon_high: float | None = None,
    beta: float = 0.0,
    reference: torch.Tensor | None = None,
    aggregate: Aggregate = "dapo",
    owner: torch.Tensor | None = None,
    seq_tokens: torch.Tensor | None = None,
    importance: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The loss a micro-batch backpropagates, and per token whether its ratio was clipped (fp32 0/1)
    and its KL (zeros without ``reference``). ``logp``, ``old``, ``advantages``, ``mask`` and
    ``reference``: [tokens]; ``owner``: each token's completion, ``seq_tokens``: each completion's
    counted tokens (both for ``aggregate="grpo"``); ``importance``: each token's weight of the
    surrogate (rollouts another engine drew: :mod:`slipstream.loss.importance`), the KL unweighted,
    as TRL weighs them."""
    ratio = torch.exp(logp - old)
    low, high = epsilon, epsilon_high if epsilon_high is not None else epsilon
    clipped_ratio = ratio.clamp(1 - low, 1 + high)
    per_token = -torch.minimum(ratio * advantages, clipped_ratio * advantages)
    if importance is not None:
        per_token = per_token * importance
    kl = torch.zeros_like(per_token)
    if reference is not None:
        delta = reference.to(logp.device) - logp
        kl = torch.exp(delta) - delta - 1
        per_token = per_token + beta * kl
    if aggregate == "grpo":
        per_seq = torch.zeros_like(seq_tokens).index_add(0, owner, per_token * mask)
        loss = (per_seq / seq_tokens.clamp(min=1)).sum() / weight
    else:
        loss = (per_token * mask).sum() / weight
    clipped = (((ratio < 1 - low) & (advantages < 0)) | ((ratio > 1 + high) & (advantages > 0))).float()
    return loss, clipped, kl


def loss_divisor(aggregate: Aggregate, completions: float, tokens: float, max_new_tokens: int) -> float:
    """What the step's summed loss is divided by: ``dapo`` its counted tokens, ``grpo`` its
    completions, ``dr_grpo`` completions x max_new_tokens (every rank's)."""
    if aggregate == "dapo":
        return max(1.0, tokens)
    if aggregate == "grpo":
        return completions
    return completions * max_new_tokens
