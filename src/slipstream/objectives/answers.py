"""Answers' summed log-probs on a packed batch (the policy's, and the reference's with the adapter off),
what the pair objectives and GRPO read; and, on packed pairs, a micro-batch's loss and metric sums,
the reference pass and evaluation.

The optimizer step is the one every objective takes (``train.step.train_step``): forward +
backward every micro-batch through :func:`pair_loss` (each micro-batch's summed pair losses
divided by the pair count of the whole step: every pair weighs the same wherever it was packed),
clip, and one host read of the loss, the gradient norm and the reward metrics together before
the update, which is dropped when either is not finite.

A pair micro-batch is a :class:`PackedBatch` from :func:`slipstream.packing.pairs.collate_pairs`
(GRPO's: from :func:`slipstream.packing.completions.collate_completions`, a completion an answer).
The model's forward gives every answer's summed log-prob: through the chunked loss (no logits; the
sums are left on the batch), or, with the chunked loss off, from the logits.

The reference (for DPO and IPO, and GRPO's KL) is the base model: with LoRA the same model with the
adapter off. ``precomputed`` (the pairs' default): one ``no_grad`` pass over every bin before step 0
(:func:`reference_pass`, cached by :mod:`.reference`), with the policy as it starts (a LoRA adapter
starts at zero, so this is the base), kept per bin; ``per_step``: each micro-batch's reference
forward runs in the step, under ``disable_adapter()``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import nullcontext
from typing import Any

import torch

from ..loss import answer_logprobs_from_logits, answer_logprobs_of
from ..loss.preference import METRICS, PairTerms, metric_sums
from ..modes import eval_mode
from ..packing.batch import PackedBatch
from ..packing.pairs import collate_pairs


def _inputs(batch: PackedBatch, chunked: bool) -> dict[str, Any]:
    inputs = batch.model_inputs()
    if not chunked:
        inputs.pop("labels")  # the stock forward: logits, and no SFT loss computed beside them
    return inputs


def answer_sums(model: torch.nn.Module, batch: PackedBatch, chunked: bool) -> torch.Tensor:
    """[answers] fp32: every answer's summed log-prob under ``model`` (differentiable when grad is on)."""
    out = model(**_inputs(batch, chunked))
    if chunked:
        sums = answer_logprobs_of(batch)
        if sums is None:
            raise RuntimeError(
                "the chunked loss did not run on this preference batch: the model's forward hooks were "
                "skipped (a PEFT older than 0.21 calls the wrapped model's forward() directly; pip install "
                "'peft>=0.21'), or speedups.chunked_loss is off"
            )
        return sums
    answers = batch.answers
    return answer_logprobs_from_logits(
        out.logits,
        answers.positions,
        answers.targets,
        answers.index,
        answers.num_answers,
        answers.temperature,
    )


def adapter_off(model: torch.nn.Module):
    """``disable_adapter()`` of a PEFT model (under DDP: of the module it wraps)."""
    inner = getattr(model, "module", model)
    disable = getattr(inner, "disable_adapter", None)
    if disable is None:
        raise ValueError("preference.reference per_step needs a LoRA model (the base is the adapter off)")
    return disable()


def reference_sums(model: torch.nn.Module, batch: PackedBatch, chunked: bool, adapter: bool) -> torch.Tensor:
    """The reference's [answers] sums: ``no_grad``, eval mode (no dropout), the adapter off if ``adapter``."""
    with eval_mode(model), torch.no_grad(), adapter_off(model) if adapter else nullcontext():
        return answer_sums(model, batch, chunked).detach()


def pair_loss(
    model: torch.nn.Module,
    batch: PackedBatch,
    reference: torch.Tensor | None,
    terms: Callable[[torch.Tensor, torch.Tensor | None, torch.Tensor], PairTerms],
    chunked: bool,
    pairs: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One micro-batch of pairs: the loss it backpropagates (its pairs' summed losses over the
    step's ``pairs``, so every pair weighs the same wherever it was packed) and its metric sums."""
    policy = answer_sums(model, batch, chunked)
    found = terms(
        policy, None if reference is None else reference.to(policy.device), batch.answers.token_counts
    )
    return found.losses.sum() / pairs, metric_sums(found)


def reference_pass(
    model: torch.nn.Module,
    bins: Sequence[Sequence[dict]],
    *,
    prefix_sharing: bool,
    device: torch.device | str,
    chunked: bool,
    adapter: bool = False,
) -> list[torch.Tensor]:
    """Every bin's reference sums, once (``no_grad``, eval mode): the one reference pass ``train``
    (cached, ``preference.reference``) and the A/B's pair arms run before step 0."""
    return [
        reference_sums(model, collate_pairs(pairs, prefix_sharing, device), chunked, adapter)
        for pairs in bins
    ]


def evaluate_pairs(
    model: torch.nn.Module,
    batches: Sequence[tuple[PackedBatch, Any] | tuple[PackedBatch, Any, bool]],
    *,
    step: Callable[[torch.nn.Module, tuple[PackedBatch, Any]], torch.Tensor],
    metrics: Sequence[str] = METRICS,
    reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> dict[str, float]:
    """The ``metrics`` over held-out pairs (``no_grad``, eval mode), every pair weighing the same;
    ``step(model, (batch, prepared))``: a micro-batch's metric sums (the objective's own, as it trains).
    A batch given as ``(batch, prepared, False)`` runs but does not count (under FSDP2 every rank
    runs as many forwards, the last ones padded with a repeated batch)."""
    sums, pairs = None, 0
    with eval_mode(model), torch.no_grad():
        for batch, prepared, *counted in batches:
            found = step(model, (batch, prepared))
            counts = not counted or counted[0]
            found = found * (1.0 if counts else 0.0)
            sums = found if sums is None else sums + found
            pairs += batch.answers.num_pairs if counts else 0
    count = torch.tensor([float(pairs)], device=sums.device)
    both = torch.cat([sums.float(), count])
    if reduce is not None:
        both = reduce(both)
    values = both.tolist()
    return {name: value / values[-1] for name, value in zip(metrics, values[:-1], strict=True)}
