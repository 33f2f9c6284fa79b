"""One optimizer step over micro-batches, weighting every label token the same.

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

# A micro-batch is whatever the arm feeds the model: kwargs plus its label-token count.
MicroBatch = tuple[dict[str, Any], int]


def train_step(
    model: torch.nn.Module,
    micro_batches: Sequence[MicroBatch],
    optimizer: torch.optim.Optimizer,
    max_grad_norm: float | None = 1.0,
    model_context: Callable[[], AbstractContextManager] = nullcontext,
    global_tokens: int | None = None,
    loss_scale: float = 1.0,
    reduce_loss: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> dict[str, Any]:
    """Forward + backward every micro-batch, clip, step (if finite), zero. Returns loss and grad norm.

    The returned loss is the token-weighted mean over the whole step, the number a single
    batch holding all micro-batches would report. ``model_context`` wraps each forward +
    backward (and nothing else), e.g. a host-sync counter.

    Data parallel: ``global_tokens`` is the label-token count of the step over all ranks
    (this rank's loss is then its share of the global mean) and ``loss_scale`` the world
    size, undoing the gradient averaging of DDP / FSDP2; ``reduce_loss`` sums this rank's
    share over the ranks on the device, so every rank reads the same loss and grad norm and
    makes the same decision. ``finite`` in the result is False when the update was dropped.
    """
    total_tokens = global_tokens if global_tokens is not None else sum(tokens for _, tokens in micro_batches)
    if total_tokens == 0:
        raise ValueError("a training step with no label tokens")
    device = micro_batches[0][0]["input_ids"].device if micro_batches else torch.device("cpu")
    items = torch.tensor(total_tokens, dtype=torch.float32).to(device)  # moved once per step
    loss_sum: torch.Tensor | None = None  # stays on the device: one read per step, at the end
    clock = _PhaseClock()
    for inputs, _ in micro_batches:
        if "num_items_in_batch" not in inputs:
            inputs = {**inputs, "num_items_in_batch": items}
        with model_context():
            clock.mark(inputs["input_ids"].device)
            loss = model(**inputs).loss
            clock.mark(inputs["input_ids"].device)
            (loss * loss_scale if loss_scale != 1.0 else loss).backward()
            clock.mark(inputs["input_ids"].device)
        loss_sum = loss.detach().float() if loss_sum is None else loss_sum + loss.detach().float()
    params = [p for p in model.parameters() if p.grad is not None]
    grad_norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm if max_grad_norm else float("inf"))
    if hasattr(grad_norm, "full_tensor"):  # a DTensor under FSDP2
        grad_norm = grad_norm.full_tensor()
    if loss_sum is None:
        loss_sum = torch.zeros((), device=device)
    if reduce_loss is not None:
        loss_sum = reduce_loss(loss_sum)
    # The step's one host read: loss and grad norm in one transfer, before the update.
    loss, norm = torch.stack([loss_sum.float(), grad_norm.float().to(loss_sum.device)]).tolist()
    finite = math.isfinite(loss) and math.isfinite(norm)
    if finite:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    forward_s, backward_s = clock.phases()
    return {
        "loss": loss,
        "grad_norm": norm,
        "finite": finite,
        "forward_s": forward_s,
        "backward_s": backward_s,
    }


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
