"""The preference objective's step, reference pass and evaluation, on packed pair batches.

One optimizer step mirrors ``train.step.train_step`` (which the SFT objective uses): forward +
backward every micro-batch, each micro-batch's summed pair losses divided by the pair count of
the whole step (every pair weighs the same wherever it was packed), clip, and one host read of
the loss, the gradient norm and the reward metrics together before the update, which is dropped
when either is not finite.

A micro-batch is a :class:`PackedBatch` from :func:`slipstream.packing.pairs.collate_pairs`. The
model's forward gives every answer's summed log-prob: through the chunked loss (no logits; the
sums are left on the batch), or, with the chunked loss off, from the logits.

The reference (for DPO and IPO) is the base model: with LoRA the same model with the adapter off.
``precomputed`` (the default): one ``no_grad`` pass over every bin before step 0, with the policy
as it starts (a LoRA adapter starts at zero, so this is the base), kept per bin; ``per_step``:
each micro-batch's reference forward runs in the step, under ``disable_adapter()``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from typing import Any

import torch

from ..loss import answer_logprobs_from_logits, answer_logprobs_of
from ..modes import eval_mode
from ..packing.batch import PackedBatch
from .losses import METRICS, metric_sums, preference_terms


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
        out.logits, answers.positions, answers.targets, answers.index, answers.num_answers
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


def preference_step(
    model: torch.nn.Module,
    micro_batches: Sequence[tuple[PackedBatch, torch.Tensor | None]],
    optimizer: torch.optim.Optimizer,
    *,
    loss: str,
    beta: float,
    simpo_gamma: float = 1.0,
    chunked: bool = True,
    reference: Callable[[PackedBatch], torch.Tensor] | None = None,
    max_grad_norm: float | None = 1.0,
    global_pairs: int | None = None,
    loss_scale: float = 1.0,
    reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
    model_context: Callable = nullcontext,
) -> dict[str, Any]:
    """One optimizer step over ``micro_batches``: ``(batch, reference sums or None)`` each; a None is
    computed by ``reference(batch)`` in the step (``per_step``). Returns the step's mean loss,
    reward metrics (``METRICS``), grad norm and whether it was applied (``finite``)."""
    pairs = global_pairs if global_pairs is not None else sum(b.answers.num_pairs for b, _ in micro_batches)
    if pairs == 0:
        raise ValueError("a preference step with no pairs")
    sums = None
    forward_s = backward_s = 0.0
    for batch, ref in micro_batches:
        with model_context():
            if ref is None and reference is not None:
                ref = reference(batch)
            started = time.perf_counter()
            policy = answer_sums(model, batch, chunked)
            terms = preference_terms(
                loss,
                policy,
                None if ref is None else ref.to(policy.device),
                batch.answers.token_counts,
                beta,
                simpo_gamma,
            )
            step_loss = terms.losses.sum() / pairs
            forwarded = time.perf_counter()
            (step_loss * loss_scale if loss_scale != 1.0 else step_loss).backward()
            forward_s += forwarded - started
            backward_s += time.perf_counter() - forwarded
        found = metric_sums(terms)
        sums = found if sums is None else sums + found
    params = [p for p in model.parameters() if p.grad is not None]
    grad_norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm if max_grad_norm else float("inf"))
    if hasattr(grad_norm, "full_tensor"):  # a DTensor under FSDP2
        grad_norm = grad_norm.full_tensor()
    if reduce is not None:
        sums = reduce(sums)
    # the step's one host read: the metrics and the grad norm together, before the update
    values = torch.cat([sums.float(), grad_norm.float().reshape(1).to(sums.device)]).tolist()
    norm = values[-1]
    metrics = {name: value / pairs for name, value in zip(METRICS, values[:-1], strict=True)}
    finite = math.isfinite(metrics["loss"]) and math.isfinite(norm)
    if finite:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return {**metrics, "grad_norm": norm, "finite": finite, "forward_s": forward_s, "backward_s": backward_s}


def evaluate_pairs(
    model: torch.nn.Module,
    batches: Sequence[
        tuple[PackedBatch, torch.Tensor | None] | tuple[PackedBatch, torch.Tensor | None, bool]
    ],
    *,
    loss: str,
    beta: float,
    simpo_gamma: float = 1.0,
    chunked: bool = True,
    reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> dict[str, float]:
    """The ``METRICS`` over held-out pairs (``no_grad``, eval mode), every pair weighing the same.
    A batch given as ``(batch, reference, False)`` runs but does not count (under FSDP2 every rank
    runs as many forwards, the last ones padded with a repeated batch)."""
    sums, pairs = None, 0
    with eval_mode(model), torch.no_grad():
        for batch, ref, *counted in batches:
            policy = answer_sums(model, batch, chunked)
            terms = preference_terms(
                loss,
                policy,
                None if ref is None else ref.to(policy.device),
                batch.answers.token_counts,
                beta,
                simpo_gamma,
            )
            counts = not counted or counted[0]
            found = metric_sums(terms) * (1.0 if counts else 0.0)
            sums = found if sums is None else sums + found
            pairs += batch.answers.num_pairs if counts else 0
    count = torch.tensor([float(pairs)], device=sums.device)
    both = torch.cat([sums.float(), count])
    if reduce is not None:
        both = reduce(both)
    values = both.tolist()
    return {name: value / values[-1] for name, value in zip(METRICS, values[:-1], strict=True)}
