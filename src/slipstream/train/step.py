"""The one optimizer step over micro-batches, for every objective, weighting every label token (pair) the same.

Gradient accumulation that averages per-micro-batch mean losses over-weights the tokens of
short micro-batches. Here each micro-batch's summed loss is divided by the label-token count
of the whole step (``num_items_in_batch``), which is the loss of one big batch.

A step whose loss or gradient norm is not finite is never applied: the two are read to the
host together, once, before the optimizer runs (the step's one host read, moved ahead of the
update rather than added), and the update is dropped if either is NaN or infinite. What the
run does then (stop, or go on) is the caller's policy (``training.on_nonfinite``).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch


def train_step(
    model: torch.nn.Module,
    micro_batches: Sequence[Any],
    optimizer: torch.optim.Optimizer,
    max_grad_norm: float | None = 1.0,
    model_context: Callable[[], AbstractContextManager] = nullcontext,
    global_tokens: int | None = None,
    loss_scale: float = 1.0,
    reduce_loss: Callable[[torch.Tensor], torch.Tensor] | None = None,
    objective: Any = None,
) -> dict[str, Any]:
    """Forward + backward every micro-batch, clip, step (if finite), zero; the one step of every objective.

    ``objective`` (``slipstream.objectives``; default SFT, whose micro-batches are
    ``(model kwargs, label tokens)``) gives each micro-batch's loss and metric sums. The returned
    metrics (``objective.metrics``: "loss" and, e.g., the reward metrics) are the step's means, the
    numbers a single batch holding all micro-batches would report. ``model_context`` wraps each
    forward + backward (and nothing else), e.g. a host-sync counter.

    Data parallel: ``global_tokens`` is the step's weight over all ranks (its label tokens, its
    pairs: this rank's loss is then its share of the global mean) and ``loss_scale`` the world
    size, undoing the gradient averaging of DDP / FSDP2; ``reduce_loss`` sums this rank's metric
    sums over the ranks on the device, so every rank reads the same loss and grad norm and
    makes the same decision. ``finite`` in the result is False when the update was dropped.
    """
    if objective is None:
        from ..objectives.sft import SFT

        objective = SFT(None)
    total = (
        global_tokens if global_tokens is not None else sum(objective.micro_weight(m) for m in micro_batches)
    )
    if total == 0:
        raise ValueError("a training step with nothing to weigh its loss (no label tokens, no pairs)")
    device = objective.model_device(micro_batches[0]) if micro_batches else torch.device("cpu")
    weight = objective.step_weight(total, device)
    sums: torch.Tensor | None = None  # stays on the device: one read per step, at the end
    clock = _PhaseClock()
    for micro in micro_batches:
        with model_context():
            micro = objective.ready(model, micro)  # e.g. a per-step reference forward, outside the clock
            clock.mark(device)
            loss, found = objective.micro_batch(model, micro, weight)
            clock.mark(device)
            (loss * loss_scale if loss_scale != 1.0 else loss).backward()
            clock.mark(device)
        sums = found if sums is None else sums + found
    params = [p for p in model.parameters() if p.grad is not None]
    grad_norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm if max_grad_norm else float("inf"))
    if hasattr(grad_norm, "full_tensor"):  # a DTensor under FSDP2
        grad_norm = grad_norm.full_tensor()
    if sums is None:
        sums = torch.zeros(len(objective.metrics), device=device)
    if reduce_loss is not None:
        sums = reduce_loss(sums)
    # The step's one host read: the metric sums and the grad norm in one transfer, before the update.
    values = torch.cat([sums.float(), grad_norm.float().reshape(1).to(sums.device)]).tolist()
    norm, divisor = values[-1], objective.divisor(total)
    metrics = objective.finish_metrics(
        {name: value / divisor for name, value in zip(objective.metrics, values[:-1], strict=True)}
    )
    finite = math.isfinite(metrics["loss"]) and math.isfinite(norm)
    if finite:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    forward_s, backward_s = clock.phases()
    return {**metrics, "grad_norm": norm, "finite": finite, "forward_s": forward_s, "backward_s": backward_s}


class _PhaseClock:
    """Forward and backward time of a step: CUDA events on a GPU (read once, after the step's
    own sync point), the host clock elsewhere. Marks come in triples: start, forward done,
    backward done."""

    def __init__(self):
        self.marks: list = []

    def mark(self, device: torch.device) -> None:
        if device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    def phases(self) -> tuple[float, float]:
        forward = backward = 0.0
        for start, middle, end in zip(self.marks[0::3], self.marks[1::3], self.marks[2::3], strict=True):
            if isinstance(start, float):
                forward += middle - start
                backward += end - middle
            else:
                end.synchronize()
                forward += start.elapsed_time(middle) / 1000
                backward += middle.elapsed_time(end) / 1000
        return forward, backward
