"""Summed log-probs of answers through the LM head a chunk at a time: no [tokens, vocab] logits.

A preference loss reads one number per answer, ``s_a = sum_{t in a} log p(target_t | x_<t)``,
then a nonlinear function of those numbers (DPO's log-sigmoid). So, unlike the SFT loss, the
weight of each token's gradient, ``dL/ds_a``, is known only after the forward. For each chunk
of labelled rows:

    z = transform(head(x_c))                 [c, V]
    logp_t = z[target_t] - logsumexp(z)      fp32
    d logp_t / dz = onehot(target_t) - softmax(z)

With a frozen head (LoRA), the forward turns ``d logp_t / dz`` into ``d logp_t / dx_t`` while
the chunk's logits are alive and keeps that ``[N, H]`` (what the SFT loss keeps); backward
scales each row by ``dL/ds_a`` of its answer: the FLOPs of the stock loss, one head forward and
one backward. A trainable head (full fine-tuning, ``lm_head`` in ``modules_to_save``) needs the
weights ``dL/ds_a`` inside its parameter gradient, so there the forward keeps nothing and
backward runs each chunk through the head again (a second head forward: stated, not hidden).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from .linear_ce import LinearHead, LogitTransform


def _logits(head, transform: LogitTransform, rows: torch.Tensor) -> torch.Tensor:
    if isinstance(head, LinearHead):
        return transform(F.linear(rows, head.weight, head.bias))
    return transform(head(rows))


def _d_logp_d_z(z: torch.Tensor, targets: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
    """``weights * (onehot(target) - softmax(z))``, fp32, written over ``z`` (which nothing else reads)."""
    lse = torch.logsumexp(z, dim=-1, keepdim=True)
    grad = z.sub_(lse).exp_().neg_()
    grad.scatter_add_(1, targets.unsqueeze(1), torch.ones_like(targets, dtype=grad.dtype).unsqueeze(1))
    return grad if weights is None else grad.mul_(weights.unsqueeze(1))


def _linear_chain(head: LinearHead, transform: LogitTransform, logits: torch.Tensor, grad: torch.Tensor):
    """d/d(head output) of ``transform``, by hand (a plain linear head runs no autograd)."""
    if transform.temperature is not None:  # y / T, applied last: its chain first, on y before it
        grad = grad / transform.temperature
        logits = logits.float() * transform.temperature
    if transform.softcap is not None:  # d(cap * tanh(u / cap))/du = 1 - (y / cap)^2
        grad = grad * (1 - (logits.float() / transform.softcap).square())
    if transform.scale is not None:
        grad = grad * transform.scale
    return grad.to(head.weight.dtype)


def _chunk(head, transform, rows, targets, want_hidden_grad: bool):
    """One chunk: the per-token log-probs [c] (fp32) and, if asked, d logp / d rows [c, H]."""
    if isinstance(head, LinearHead):  # matmuls only, the chain rule by hand
        logits = _logits(head, transform, rows)
        z = logits.float()
        logp = z.gather(1, targets.unsqueeze(1)).squeeze(1) - torch.logsumexp(z, dim=-1)
        if not want_hidden_grad:
            return logp, None
        grad = _linear_chain(
            head, transform, logits, _d_logp_d_z(z if z is not logits else z.clone(), targets)
        )
        return logp, grad @ head.weight
    with torch.set_grad_enabled(want_hidden_grad):
        rows = rows.detach().requires_grad_(want_hidden_grad)
        logits = _logits(head, transform, rows)
    z = logits.detach().float()
    logp = z.gather(1, targets.unsqueeze(1)).squeeze(1) - torch.logsumexp(z, dim=-1)
    if not want_hidden_grad:
        return logp, None
    grad_z = _d_logp_d_z(z if z is not logits else z.clone(), targets)
    (grad_rows,) = torch.autograd.grad(logits, [rows], grad_outputs=grad_z.to(logits.dtype))
    return logp, grad_rows


class _AnswerLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden_NH, targets_N, index_N, num_answers, head, transform, chunk_tokens, *params):
        trainable = [p for i, p in enumerate(params) if ctx.needs_input_grad[7 + i]]
        keep_grad = ctx.needs_input_grad[0] and not trainable
        sums = torch.zeros(num_answers, dtype=torch.float32, device=hidden_NH.device)
        hidden_grad = torch.empty_like(hidden_NH) if keep_grad else None
        for start in range(0, hidden_NH.shape[0], chunk_tokens):
            end = min(start + chunk_tokens, hidden_NH.shape[0])
            logp, grad_rows = _chunk(head, transform, hidden_NH[start:end], targets_N[start:end], keep_grad)
            sums.index_add_(0, index_N[start:end], logp)
            if keep_grad:
                hidden_grad[start:end] = grad_rows
        ctx.head, ctx.transform, ctx.chunk_tokens = head, transform, chunk_tokens
        ctx.num_params = len(params)
        ctx.keep_grad = keep_grad
        if keep_grad:
            ctx.save_for_backward(index_N, hidden_grad)
        else:
            ctx.save_for_backward(index_N, hidden_NH, targets_N, *params)
        return sums

    @staticmethod
    def backward(ctx, grad_sums):
        index_N, *saved = ctx.saved_tensors
        weights_N = grad_sums.float().index_select(0, index_N)  # dL/ds_a of each row's answer
        none = [None] * 6
        if ctx.keep_grad:
            (hidden_grad,) = saved
            scaled = hidden_grad * weights_N.unsqueeze(1).to(hidden_grad.dtype)
            return (scaled, *none, *[None] * ctx.num_params)
        hidden_NH, targets_N, *params = saved
        need_hidden = ctx.needs_input_grad[0]
        need = [ctx.needs_input_grad[7 + i] for i in range(len(params))]
        trainable = [p for p, n in zip(params, need, strict=True) if n]
        hidden_grad = torch.zeros_like(hidden_NH) if need_hidden else None
        param_grads = [
            torch.zeros_like(p, dtype=torch.promote_types(p.dtype, torch.float32)) for p in trainable
        ]
        head = ctx.head
        for start in range(0, hidden_NH.shape[0], ctx.chunk_tokens):
            end = min(start + ctx.chunk_tokens, hidden_NH.shape[0])
            targets, weights = targets_N[start:end], weights_N[start:end]
            if isinstance(head, LinearHead):  # matmuls only, the chain rule by hand
                rows = hidden_NH[start:end]
                logits = _logits(head, ctx.transform, rows)
                grad = _linear_chain(
                    head, ctx.transform, logits, _d_logp_d_z(logits.float().clone(), targets, weights)
                )
                if need_hidden:
                    hidden_grad[start:end] = grad @ head.weight
                for param, accumulator in zip(trainable, param_grads, strict=True):
                    if param is head.weight:
                        accumulator += (grad.t() @ rows).float()
                    elif param is head.bias:
                        accumulator += grad.float().sum(0)
                continue
            with torch.enable_grad():
                rows = hidden_NH[start:end].detach().requires_grad_(need_hidden)
                logits = _logits(head, ctx.transform, rows)
            grad_z = _d_logp_d_z(logits.detach().float().clone(), targets, weights)
            inputs = ([rows] if need_hidden else []) + trainable
            grads = torch.autograd.grad(logits, inputs, grad_outputs=grad_z.to(logits.dtype))
            if need_hidden:
                hidden_grad[start:end] = grads[0]
                grads = grads[1:]
            for accumulator, grad in zip(param_grads, grads, strict=True):
                accumulator += grad
        grads = iter(g.to(p.dtype) for g, p in zip(param_grads, trainable, strict=True))
        return (hidden_grad, *none, *(next(grads) if n else None for n in need))


def answer_logprobs(
    hidden_NH: torch.Tensor,
    targets_N: torch.Tensor,
    index_N: torch.Tensor,
    num_answers: int,
    head: Callable[[torch.Tensor], torch.Tensor] | LinearHead,
    head_params: Sequence[torch.Tensor] = (),
    transform: LogitTransform | None = None,
    chunk_tokens: int = 1024,
) -> torch.Tensor:
    """``[num_answers]`` fp32: the summed log-prob of each answer's targets (row n belongs to
    answer ``index_N[n]``), computed ``chunk_tokens`` rows at a time; differentiable in
    ``hidden_NH`` and ``head_params`` (the head's trainable tensors, as in ``linear_cross_entropy``)."""
    if hidden_NH.dim() != 2:
        raise ValueError(f"hidden rows must be [N, H], got {tuple(hidden_NH.shape)}")
    transform = transform or LogitTransform()
    if not torch.is_grad_enabled():
        sums = torch.zeros(num_answers, dtype=torch.float32, device=hidden_NH.device)
        for start in range(0, hidden_NH.shape[0], chunk_tokens):
            end = min(start + chunk_tokens, hidden_NH.shape[0])
            logp, _ = _chunk(head, transform, hidden_NH[start:end], targets_N[start:end], False)
            sums.index_add_(0, index_N[start:end], logp)
        return sums
    return _AnswerLogProbs.apply(
        hidden_NH, targets_N, index_N, num_answers, head, transform, chunk_tokens, *head_params
    )


def answer_logprobs_from_logits(
    logits_1TV: torch.Tensor, positions, targets, index, num_answers: int, temperature: float = 1.0
):
    """The same sums from full logits (the stock path, with the chunked loss off): [num_answers] fp32."""
    rows = logits_1TV[0].index_select(0, positions).float()
    if temperature != 1.0:
        rows = rows / temperature
    logp = rows.log_softmax(-1).gather(1, targets.unsqueeze(1)).squeeze(1)
    return torch.zeros(num_answers, dtype=torch.float32, device=rows.device).index_add(0, index, logp)
