"""LM head + cross-entropy a chunk of tokens at a time: the [tokens, vocab] logits never exist.

With a real vocabulary (128k-201k tokens) the logits of a long packed row, their fp32 copy,
their log-softmax and their gradient are most of a training step's activation memory. Here
the head runs on ``chunk_tokens`` rows at a time and each chunk's gradient is computed in
the same pass as its loss, while its logits are alive:

    z = transform(head(x_c))                      [c, V]  (the model's dtype)
    lse = log sum_v exp(z_v)                      fp32, per row
    loss_c = sum_rows (lse - z[target])           fp32
    dL/dz = (softmax(z) - onehot(target)) / N     fp32, written over z in place, then cast

and the head's backward turns dL/dz into the gradients of the chunk's hidden rows and of the
head's trainable parameters, which are kept (hidden rows: [N, H]; parameters: their own size)
and handed to autograd in backward, scaled by the incoming gradient. Why the same pass rather
than recomputing each chunk in backward: it costs exactly the FLOPs of the stock loss (one head
forward, one head backward), where recomputation pays a second head forward - a third more
time on a head that dominates the step. A plain ``nn.Linear`` head (frozen under LoRA, trained
in a full fine-tune, tied or not) takes a fast path: its matmuls write into buffers reused by
every chunk, and the transform's chain rule is written out. Any other head - a PEFT LoRA layer
(with dropout), a ``modules_to_save`` wrapper, a 4-bit layer - runs as a module under
``torch.autograd.grad``, so it trains exactly as it would under the stock loss.

Only the rows that carry a label are given to this function (the caller selects them), so
masked prompt tokens cost no head FLOPs at all.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

# Memory one chunk may use on a CPU, where free memory is not a meaningful budget, and the fewest
# rows a CPU chunk takes. At vocabulary 151,936 (qwen3-bench-cpu, 1,024-token steps) 128-row
# chunks were as fast as 192-384-row ones in fp32 and bf16 and kept 65-150 MB less resident
# (BENCHMARKS.md, issue 13); a small vocabulary still gets one big chunk.
CPU_CHUNK_BUDGET_BYTES = 64 << 20
CPU_MIN_CHUNK_TOKENS = 128
# On CUDA: this share of the memory free when the loss first runs, within these bounds.
CUDA_FREE_SHARE = 0.25
MIN_CHUNK_TOKENS, MAX_CHUNK_TOKENS = 64, 16384
CHUNK_MULTIPLE = 64


@dataclass(frozen=True)
class LogitTransform:
    """What a model does to the head's output before its loss: ``softcap(logits * scale)``.

    Covers the families that scale (Granite, Cohere, Falcon-H1, HyperCLOVA X) or soft-cap
    (Gemma 2/3, RecurrentGemma, xLSTM) their logits; the ops are the ones transformers runs,
    in the same dtype, so the chunked loss sees the logits the stock loss would.
    """

    scale: float | None = None
    softcap: float | None = None
    # sampling's temperature, applied last (online RL's log-probs of the distribution it sampled from)
    temperature: float | None = None

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        if self.scale is not None:
            logits = logits * self.scale
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        if self.temperature is not None:
            logits = logits / self.temperature
        return logits

    def describe(self) -> str:
        parts = [f"scale {self.scale:g}"] if self.scale is not None else []
        parts += [f"softcap {self.softcap:g}"] if self.softcap is not None else []
        parts += [f"temperature {self.temperature:g}"] if self.temperature is not None else []
        return ", ".join(parts) or "none"


def bytes_per_chunk_row(vocab_size: int, dtype: torch.dtype) -> int:
    """Bytes one row of a chunk holds at once: its logits, their fp32 working copy, their gradient."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    fp32_copy = 0 if dtype == torch.float32 else 4
    grad_cast = 0 if dtype == torch.float32 else itemsize
    return vocab_size * (itemsize + fp32_copy + grad_cast)


def choose_chunk_tokens(
    vocab_size: int, dtype: torch.dtype, device: torch.device, override: int | None = None
) -> tuple[int, str]:
    """Rows per chunk and the reason: a memory budget over what one row costs."""
    row = bytes_per_chunk_row(vocab_size, dtype)
    if override is not None:
        if override < 1:
            raise ValueError(f"loss_chunk_tokens must be at least 1, got {override}")
        return override, f"{override} tokens per chunk (set), {override * row / 2**20:.0f} MiB"
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        free += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        budget, source = int(free * CUDA_FREE_SHARE), f"{CUDA_FREE_SHARE:.0%} of {free / 2**30:.1f} GiB free"
    else:
        budget, source = CPU_CHUNK_BUDGET_BYTES, "the CPU budget"
    fewest = MIN_CHUNK_TOKENS if device.type == "cuda" else CPU_MIN_CHUNK_TOKENS
    tokens = max(fewest, min(MAX_CHUNK_TOKENS, budget // row))
    tokens = max(CHUNK_MULTIPLE, tokens // CHUNK_MULTIPLE * CHUNK_MULTIPLE)
    return tokens, (
        f"{tokens} tokens per chunk ({tokens * row / 2**20:.0f} MiB of {source}; vocab {vocab_size}, "
        f"{str(dtype).removeprefix('torch.')})"
    )


@dataclass(frozen=True)
class LinearHead:
    """A plain linear head given as its tensors: the fast path (matmuls into reused buffers).

    Only for an exact ``torch.nn.Linear`` without hooks of its own: anything else (a PEFT
    layer, a 4-bit layer, a subclass) goes through its module, under autograd.
    """

    weight: torch.Tensor  # [V, H]
    bias: torch.Tensor | None = None


class _Buffers:
    """[c, V] working tensors allocated once per call and reused by every chunk: on a CPU a fresh
    tensor this large bypasses malloc's free lists, and its page faults cost as much as a pass."""

    def __init__(self, chunk_rows: int):
        self.chunk_rows, self.made = chunk_rows, {}

    def rows(
        self, name: str, like: torch.Tensor, rows: int, dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        """The first ``rows`` rows of a [chunk_rows, like.shape[1]] buffer."""
        if name not in self.made:
            shape = (self.chunk_rows, like.shape[1])
            self.made[name] = torch.empty(shape, dtype=dtype or like.dtype, device=like.device)
        return self.made[name][:rows]

    def like(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        if name not in self.made:
            self.made[name] = torch.empty_like(tensor)
        return self.made[name]


def _loss_and_grad_in_place(z, targets, ignore_index, divisor, want_grad):
    """Summed CE of fp32 logits ``z`` [c, V]; with ``want_grad`` z becomes dL/dz (divided by ``divisor``)."""
    valid = targets != ignore_index
    safe_targets = torch.where(valid, targets, 0).unsqueeze(1)
    target_logit = z.gather(1, safe_targets).squeeze(1)
    # log-sum-exp in place: z becomes exp(z - max), so nothing of size [c, V] is allocated.
    row_max = z.amax(dim=1, keepdim=True)
    z.sub_(row_max).exp_()
    row_sum = z.sum(dim=1, keepdim=True)
    loss = torch.where(valid, (row_max + row_sum.log()).squeeze(1) - target_logit, 0.0).sum()
    if want_grad:
        # (softmax - onehot) * valid / divisor = (exp - sum * onehot) * valid / (divisor * sum):
        # the target's subtraction in fp32 (it cancels), then one scaling pass.
        z.scatter_add_(1, safe_targets, -row_sum)
        z.mul_((valid.to(torch.float32) / divisor).unsqueeze(1) / row_sum)
    return loss


def _chunks_loss_sum(hidden_NH, targets_N, chunk_tokens, head, chunk_args, hidden_grad=None) -> torch.Tensor:
    """The summed fp32 loss over ``hidden_NH``, ``chunk_tokens`` rows at a time (one set of reused
    buffers). Each chunk's step gets its rows, their targets, their rows of ``hidden_grad`` (which it
    writes) and ``chunk_args``: (transform, ignore_index, divisor, trainable, param_grads, want_grads),
    adding to ``param_grads`` with ``want_grads``. The training Function and the loss-only evaluation
    path share it."""
    loss_sum = torch.zeros((), dtype=torch.float32, device=hidden_NH.device)
    num_rows = hidden_NH.shape[0]
    buffers = _Buffers(min(chunk_tokens, max(num_rows, 1)))
    step = _linear_chunk if isinstance(head, LinearHead) else _module_chunk
    for start in range(0, num_rows, chunk_tokens):
        rows = slice(start, min(start + chunk_tokens, num_rows))
        grad_rows = hidden_grad[rows] if hidden_grad is not None else None
        loss_sum += step(head, hidden_NH[rows], targets_N[rows], grad_rows, buffers, *chunk_args)
    return loss_sum


class _LinearCrossEntropy(torch.autograd.Function):
    """Loss of ``head`` over ``hidden_NH`` rows, with the gradients computed chunk by chunk in forward."""

    @staticmethod
    def forward(ctx, hidden_NH, targets_N, divisor, head, transform, chunk_tokens, ignore_index, *params):
        need_hidden = ctx.needs_input_grad[0]
        need_params = [ctx.needs_input_grad[7 + i] for i in range(len(params))]
        trainable = [p for p, need in zip(params, need_params, strict=True) if need]
        want_grads = need_hidden or bool(trainable)
        # Gradients accumulate over chunks in fp32 where the parameter is low precision.
        param_grads = [
            torch.zeros_like(p, dtype=torch.promote_types(p.dtype, torch.float32)) for p in trainable
        ]
        hidden_grad = torch.empty_like(hidden_NH) if need_hidden else None
        chunk_args = (transform, ignore_index, divisor, trainable, param_grads, want_grads)
        loss_sum = _chunks_loss_sum(hidden_NH, targets_N, chunk_tokens, head, chunk_args, hidden_grad)
        ctx.need_params = need_params
        ctx.save_for_backward(*([hidden_grad] if need_hidden else []), *param_grads)
        ctx.param_dtypes = [p.dtype for p in trainable]
        return loss_sum / divisor

    @staticmethod
    def backward(ctx, grad_loss):
        saved = list(ctx.saved_tensors)
        hidden_grad = None
        if ctx.needs_input_grad[0]:
            hidden_grad = saved.pop(0)
            hidden_grad = hidden_grad * grad_loss.to(hidden_grad.dtype)
        param_grads = iter(
            (grad * grad_loss).to(dtype) for grad, dtype in zip(saved, ctx.param_dtypes, strict=True)
        )
        none = [None] * 6  # targets_N, divisor, head, transform, chunk_tokens, ignore_index: no gradient
        return (hidden_grad, *none, *(next(param_grads) if need else None for need in ctx.need_params))


def _module_chunk(
    head, rows, targets, hidden_grad, buffers, transform, ignore_index, divisor, trainable, param_grads, want
):
    """One chunk through the head module under autograd: any head trains as it would in stock."""
    with torch.set_grad_enabled(want):  # a loss-only chunk (no_grad) builds no graph
        rows = rows.detach().requires_grad_(hidden_grad is not None)
        logits = transform(head(rows))
    n = logits.shape[0]
    if logits.dtype == torch.float32:
        z = logits.detach()  # worked on in place: nothing in the head's backward reads its output
    else:
        z = buffers.rows("fp32", logits, n, torch.float32).copy_(logits.detach())
    loss = _loss_and_grad_in_place(z, targets, ignore_index, divisor, want)
    if want:
        grad_logits = z if logits.dtype == torch.float32 else buffers.rows("grad", logits, n).copy_(z)
        inputs = ([rows] if hidden_grad is not None else []) + trainable
        grads = torch.autograd.grad(logits, inputs, grad_outputs=grad_logits)
        if hidden_grad is not None:
            hidden_grad.copy_(grads[0])
            grads = grads[1:]
        for accumulator, grad in zip(param_grads, grads, strict=True):
            accumulator += grad
    return loss


def _linear_chunk(
    head, rows, targets, hidden_grad, buffers, transform, ignore_index, divisor, trainable, param_grads, want
):
    """One chunk of a plain linear head: matmuls into reused buffers, the transform's chain rule by hand."""
    weight, bias = head.weight, head.bias
    n = rows.shape[0]
    logits = torch.mm(rows, weight.t(), out=buffers.rows("logits", weight.t(), n, weight.dtype))
    if bias is not None:
        logits.add_(bias)
    # The transform in place, with the ops (and in the dtype) transformers runs them.
    if transform.temperature is not None:
        raise ValueError("the SFT loss has no sampling temperature (it is online RL's log-probs' alone)")
    if transform.scale is not None:
        logits.mul_(transform.scale)
    if transform.softcap is not None:
        logits.div_(transform.softcap).tanh_().mul_(transform.softcap)
    in_place = logits.dtype == torch.float32 and transform.softcap is None
    z = logits if in_place else buffers.rows("fp32", logits, n, torch.float32).copy_(logits)
    loss = _loss_and_grad_in_place(z, targets, ignore_index, divisor, want)
    if not want:
        return loss
    if transform.softcap is not None:  # d(cap * tanh(u / cap))/du = 1 - (y / cap)^2, y the capped logits
        factor = buffers.rows("factor", logits, n, torch.float32).copy_(logits)
        z.mul_(factor.div_(transform.softcap).square_().neg_().add_(1))
    if transform.scale is not None:
        z.mul_(transform.scale)
    grad_logits = z if z.dtype == weight.dtype else buffers.rows("grad", logits, n).copy_(z)
    if hidden_grad is not None:
        torch.mm(grad_logits, weight, out=hidden_grad)
    for param, accumulator in zip(trainable, param_grads, strict=True):
        if param is weight:
            if accumulator.dtype == weight.dtype:
                accumulator.addmm_(grad_logits.t(), rows)
            else:
                accumulator += torch.mm(grad_logits.t(), rows, out=buffers.like("weight_grad", weight))
        elif param is bias:
            accumulator += z.sum(dim=0)
    return loss


def linear_cross_entropy(
    hidden_NH: torch.Tensor,
    targets_N: torch.Tensor,
    head: Callable[[torch.Tensor], torch.Tensor] | LinearHead,
    head_params: Sequence[torch.Tensor],
    divisor: torch.Tensor | float | None = None,
    transform: LogitTransform | None = None,
    chunk_tokens: int = 1024,
    ignore_index: int = -100,
) -> torch.Tensor:
    """``sum_i CE(transform(head(hidden_i)), target_i) / divisor`` without the full logits.

    ``head``: a module (run under autograd, whatever it is) or a :class:`LinearHead` (the
    fast path). ``head_params``: the tensors ``head`` reads that may need gradients (its
    trainable parameters); they must be the ones ``head`` uses, since their gradients are
    returned to autograd as gradients of these very tensors. ``divisor`` defaults to the number of
    non-ignored targets (at least 1, so an all-masked batch gives a zero loss, not NaN).
    The loss is fp32, like transformers' (which upcasts the logits). Under ``torch.no_grad()``
    (evaluation) the same chunks compute the loss only: no gradient is computed or kept.
    """
    if hidden_NH.dim() != 2:
        raise ValueError(f"hidden rows must be [N, H], got {tuple(hidden_NH.shape)}")
    if divisor is None:
        divisor = (targets_N != ignore_index).sum().clamp_min(1)
    if not isinstance(divisor, torch.Tensor):
        if not math.isfinite(divisor) or divisor <= 0:
            raise ValueError(f"the loss divisor must be positive, got {divisor}")
        divisor = torch.tensor(float(divisor))
    divisor = divisor.to(device=hidden_NH.device, dtype=torch.float32)
    transform = transform or LogitTransform()
    if not torch.is_grad_enabled():
        # A no_grad forward (evaluation): the same chunks, no gradient computed or kept. The autograd
        # Function would compute (and keep) the gradients of every input that requires them - trainable
        # head parameters still do under no_grad - and a module head would run under enable_grad; here
        # each chunk's logits live only while its loss is summed.
        chunk_args = (transform, ignore_index, divisor, [], [], False)
        return _chunks_loss_sum(hidden_NH, targets_N, chunk_tokens, head, chunk_args) / divisor
    return _LinearCrossEntropy.apply(
        hidden_NH, targets_N, divisor, head, transform, chunk_tokens, ignore_index, *head_params
    )
