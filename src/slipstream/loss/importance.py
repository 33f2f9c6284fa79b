"""Importance sampling for rollouts drawn by another engine (TRL's ``vllm_importance_sampling_*``).

vLLM samples with its own kernels, so the log-prob it reports for a sampled token is not exactly the
trainer's: the rollouts are slightly off-policy. As TRL 1.16's GRPOTrainer does, each token's (or
each completion's) surrogate loss is weighted by the ratio of the trainer's probability to the
sampler's, then capped::

    token_*     w_t = exp(logp_train_t - logp_sampler_t)                  (per token)
    sequence_*  w_t = exp(sum over the completion's counted tokens of the same)   (per completion)
    *_truncate  w clamped to [clip_min, clip_max]
    *_mask      w set to 0 outside [clip_min, clip_max] (the token or completion drops out)

``logp_train`` is the policy that sampled as the trainer computes it (no gradient: the weight is a
constant of the step); a token whose sampler log-prob is unknown (NaN) differs by 0. TRL's defaults:
``sequence_mask``, clip_max 3.0, clip_min none.
"""

from __future__ import annotations

from typing import Literal

import torch

Mode = Literal["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"]


def importance_weights(
    trainer: torch.Tensor,
    sampler: torch.Tensor,
    mask: torch.Tensor,
    owner: torch.Tensor,
    completions: int,
    mode: Mode,
    clip_min: float | None,
    clip_max: float | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per token: the weight of its surrogate loss, whether the cap changed it (fp32 0/1) and the
    |log-prob difference| (0 where not counted). All [tokens]; ``owner``: each token's completion."""
    trainer = trainer.detach().float()
    difference = torch.nan_to_num((trainer - sampler.to(trainer.device).float()) * mask, nan=0.0)
    if mode.startswith("sequence"):
        per_completion = torch.zeros(completions, dtype=difference.dtype, device=difference.device)
        log_ratio = per_completion.index_add(0, owner, difference).index_select(0, owner)
    else:
        log_ratio = difference
    ratio = torch.exp(log_ratio)
    low = clip_min if clip_min is not None else -float("inf")
    high = clip_max if clip_max is not None else float("inf")
    outside = (ratio < low) | (ratio > high)
    weight = ratio.clamp(min=low, max=high) if mode.endswith("truncate") else ratio.masked_fill(outside, 0.0)
    return weight, outside.float() * mask, difference.abs()
