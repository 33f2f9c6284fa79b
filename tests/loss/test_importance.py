"""TRL's importance sampling for rollouts another engine drew, on packed tokens: the same weights as
TRL 1.16's GRPOTrainer computes on its padded [completions, tokens] layout (its formulas, transcribed
below from ``_generate_and_score_completions``), for every mode and cap."""

from __future__ import annotations

import math

import pytest
import torch

from slipstream.loss.grpo import policy_loss
from slipstream.loss.importance import importance_weights


def trl_weights(old, sampling, mask, mode, clip_min, clip_max):
    """TRL's computation on padded [B, T] tensors (grpo_trainer.py, vllm_importance_sampling_*)."""
    diff = torch.nan_to_num((old - sampling) * mask, nan=0.0)
    if mode in ("sequence_mask", "sequence_truncate"):
        diff = diff.sum(dim=-1, keepdim=True)
    ratio = torch.exp(diff)
    if mode in ("sequence_truncate", "token_truncate"):
        return (
            ratio if clip_min is None and clip_max is None else torch.clamp(ratio, min=clip_min, max=clip_max)
        )
    low = clip_min if clip_min is not None else -math.inf
    high = clip_max if clip_max is not None else math.inf
    return ratio.masked_fill((ratio < low) | (ratio > high), 0.0)


@pytest.mark.parametrize("mode", ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"])
@pytest.mark.parametrize("clip_min, clip_max", [(None, 3.0), (0.5, 2.0), (0.9, None)])
def test_the_weights_are_trls_on_the_padded_layout(mode, clip_min, clip_max):
    generator = torch.Generator().manual_seed(0)
    lengths = [5, 2, 7, 1]
    width = max(lengths)
    old = torch.randn(len(lengths), width, generator=generator) * 0.5 - 1
    sampling = old + torch.randn(len(lengths), width, generator=generator) * 0.4
    sampling[2, 3] = float("nan")  # a token the engine could not score: no correction for it
    mask = torch.zeros(len(lengths), width)
    for row, length in enumerate(lengths):
        mask[row, :length] = 1
    mask[1] = 0  # a completion left out of the loss (mask_truncated_completions)
    expected = trl_weights(old, sampling, mask, mode, clip_min, clip_max).expand(-1, width)
    # packed: the completions' tokens one after another
    keep = torch.cat([torch.arange(length) + row * width for row, length in enumerate(lengths)])
    owner = torch.cat([torch.full((length,), row) for row, length in enumerate(lengths)])
    flat = lambda t: t.reshape(-1)[keep]  # noqa: E731
    weight, changed, difference = importance_weights(
        flat(old), flat(sampling), flat(mask), owner, len(lengths), mode, clip_min, clip_max
    )
    torch.testing.assert_close(weight, flat(expected.contiguous()), rtol=1e-6, atol=0)
    counted = flat(mask)
    torch.testing.assert_close(difference, torch.nan_to_num((flat(old) - flat(sampling)).abs() * counted))
    raw = flat(
        trl_weights(
            old,
            sampling,
            mask,
            "token_truncate" if mode.startswith("token") else "sequence_truncate",
            None,
            None,
        )
        .expand(-1, width)
        .contiguous()
    )
    low = clip_min if clip_min is not None else -math.inf
    high = clip_max if clip_max is not None else math.inf
    torch.testing.assert_close(changed, (((raw < low) | (raw > high)).float() * counted))


def test_the_weight_scales_the_surrogate_not_the_kl():
    """TRL multiplies the clipped surrogate by the weight and adds beta x KL after."""
    logp = torch.tensor([-1.0, -2.0, -0.5], requires_grad=True)
    old = logp.detach()
    advantages = torch.tensor([1.0, -1.0, 0.5])
    mask = torch.ones(3)
    reference = torch.tensor([-1.2, -1.9, -0.4])
    weight = torch.tensor([0.5, 2.0, 0.0])
    plain, _, kl = policy_loss(logp, old, advantages, mask, 3.0, epsilon=0.2, beta=0.1, reference=reference)
    weighted, _, _ = policy_loss(
        logp, old, advantages, mask, 3.0, epsilon=0.2, beta=0.1, reference=reference, importance=weight
    )
    surrogate = -advantages  # ratio 1 in value
    torch.testing.assert_close(weighted, ((surrogate * weight + 0.1 * kl).sum() / 3.0))
    torch.testing.assert_close(plain, ((surrogate + 0.1 * kl).sum() / 3.0))
