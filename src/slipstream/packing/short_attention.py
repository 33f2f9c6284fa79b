"""Causal attention over short documents by two GEMMs and an fp32 softmax, on a CPU.

PyTorch's CPU flash-attention kernel (what ``scaled_dot_product_attention`` runs there) is built
for long sequences: it tiles queries and keys into blocks and, in backward, spends a fixed cost
per (batch, head) block that short documents never amortise. Measured with
``benchmarks/doc_attention.py --kernels`` (forward + backward, 2 threads, one 1,024-token row cut
into documents of L tokens), the flash kernel against this one:

- SmolLM2-135M heads (9 / 3 x 64), bf16: L=32 3.6x, 64 2.4x, 96 2.4x, 128 1.4x, 160 1.9x,
  192 0.87x (slower), 256 0.57x; fp32: 0.96-1.18x up to 160 (a wash), 0.71x at 192;
- Qwen3 heads (16 / 8 x 128), bf16: 2.3x at 32, 1.5x at 96, 1.2x at 160, 0.70x at 192.

So on a CPU documents (or length groups, :mod:`.grouping`) up to the crossover length take this
path: the crossover :mod:`.calibration` measured for this device, dtype and thread count (a model
``optimize`` set up), else the built-in rule, measured on one AMX Xeon: :data:`SHORT_MAX_LEN` tokens
in bf16 / fp16, none in fp32 (where SDPA's CPU kernel was as fast there). Longer documents, CUDA
(where the fused kernels win at every length), dropout, sinks and decoding steps keep SDPA. Keeping P from forward instead of recomputing it measured 1.1-1.4x
faster on the kernel alone (~2% of a SmolLM2 step) for T x H x L fp32 more memory per layer: not
taken.

A document that also attends to a shared prefix (a prefix group's continuation, a pair's answer:
its C queries over the prefix's keys then its own, ``Lk = P + C``) is decided on ``Lk``, the row it
stands for: it takes this kernel exactly where that row packed whole would, so sharing a prefix does
not swap the kernel and its rounding (in bf16, SDPA's CPU flash kernel's gradients measured 3-5x
further from exact than this kernel's, which round once).

The math (nanoGPT-style, per document of L tokens, GQA with r query heads per key head; a shared
prefix makes K and V ``Lk`` long and M ``[L, Lk]``, every prefix key visible):

    S = Q K^T,  P = softmax(S * scale + M),  O = P V

all in fp32 whatever the input dtype (M = 0 where causal, and in the window, -inf elsewhere;
the inputs are upcast, the outputs and gradients cast back), so bf16 training is at least as
close to exact as SDPA's own kernels, which keep fp32 scores too. At these lengths the fp32
GEMMs cost about what bf16 ones do: the time is in the calls, not the FLOPs.

Backward recomputes S and P from the saved Q, K, V (as flash attention does), so nothing of size
L x L is kept between forward and backward: memory is that of SDPA's. With dO given,

    dV = P^T dO,  dP = dO V^T,  dS = P * (dP - rowsum(P * dP)) * scale,  dQ = dS K,  dK = dS^T Q

(rowsum(P * dP) equals rowsum(dO * O), the flash form, without saving O). Query heads that
share a key head are laid side by side as one [r * L, D] block, so the GQA sums over r fall out
of the GEMMs. A right-padded group's padding queries get dO = 0 from the scatter, hence dS = 0:
they add nothing to any real key's gradient.
"""

from __future__ import annotations

import weakref
from typing import Literal

import torch

from .costs import BUILTIN, AttentionCosts

# The short-document kernel's choices, defined once (Speedups and the CLIs read them): "auto" takes
# it where it was measured faster (a CPU, bf16 / fp16, up to SHORT_MAX_LEN tokens); "on" takes it
# for every short document whatever the device and dtype (how the compatibility sweep checks it
# in fp32 on every architecture); "off" keeps SDPA.
ShortKernel = Literal["auto", "on", "off"]

# The longest document (or padded group length) that takes this path on a CPU: the measured
# crossover above (bf16: 1.2-1.9x at 160, 0.7-0.87x at 192).
SHORT_MAX_LEN = 160
RULE = (
    f"on a CPU in bf16 / fp16, documents of up to {SHORT_MAX_LEN} tokens attend by fp32 GEMMs and "
    "softmax, recomputed in backward (measured 1.2-3.6x faster than SDPA's CPU flash kernel there)"
)

# Per attention-module setting (weak keys, as GROUPING_CHOICE); a module without one runs "auto".
SHORT_KERNEL_CHOICE: weakref.WeakKeyDictionary[torch.nn.Module, str] = weakref.WeakKeyDictionary()


def measured_rule(costs: AttentionCosts, dtype: torch.dtype) -> str:
    """The "auto" rule under measured ``costs`` in ``dtype``, in words."""
    limit = costs.short_limit(dtype)
    name = str(dtype).removeprefix("torch.")
    if not limit:
        return f"SDPA for every document: the fp32-GEMM kernel was no faster than SDPA in {name} ({costs.source})"
    return (
        f"on a CPU in {name}, documents of up to {limit} tokens attend by fp32 GEMMs and softmax, recomputed "
        f"in backward: faster than SDPA's CPU flash kernel up to there ({costs.source})"
    )


def short_kernel_policy(
    mode: str, backend: str, costs: AttentionCosts = BUILTIN, dtype: torch.dtype | None = None
) -> str:
    """The policy line ``optimize`` logs for the short-document kernel on ``backend`` (``costs`` and
    ``dtype``: the model's, where its crossover was measured)."""
    if mode == "off":
        return "off (SDPA for every document)"
    if backend != "sdpa":
        return f"{mode} (unused: the {backend} backend attends the whole row in one call)"
    if mode == "on":
        return f"on (every document of up to {SHORT_MAX_LEN} tokens, any device and dtype)"
    if costs is BUILTIN or dtype is None:
        return f"auto ({RULE})"
    return f"auto ({measured_rule(costs, dtype)})"


def takes_short_kernel(
    query: torch.Tensor,
    key: torch.Tensor,
    dropout: float,
    mode: str = "auto",
    costs: AttentionCosts = BUILTIN,
) -> bool:
    """Whether one causal attention call (query ``[n, H, Lq, D]``, key ``[n, Hkv, Lk, D]``) takes this
    path under ``mode``: "on", any short document; "auto", on a CPU up to ``costs``' crossover for the
    query's dtype. ``Lk`` > ``Lq``: a document that also attends to a shared prefix, decided on ``Lk``,
    the length of the row it stands for (see the module doc)."""
    length = key.shape[-2]
    if mode == "off" or dropout != 0.0 or not query.dtype.is_floating_point:
        return False
    queries = query.shape[-2]
    if not (queries == length or 1 < queries < length) or query.shape[1] % key.shape[1] != 0:
        return False  # (one query before longer keys: a decoding step)
    if mode == "on":
        return length <= SHORT_MAX_LEN
    return query.device.type == "cpu" and length <= costs.short_limit(query.dtype)


def _additive_mask(length: int, window: int | None, device: torch.device, key_length: int) -> torch.Tensor:
    """fp32 [L, Lk]: 0 where query i sees key j (j <= i, and j > i - window), -inf elsewhere; the
    queries aligned to the end of the keys (``key_length`` > ``length``: a shared prefix first)."""
    keys = torch.arange(key_length, device=device).unsqueeze(0)
    queries = torch.arange(key_length - length, key_length, device=device).unsqueeze(1)
    hidden = keys > queries
    if window is not None:
        hidden |= keys <= queries - window
    return torch.zeros(length, key_length, device=device).masked_fill_(hidden, float("-inf"))


def _probabilities(q_blocks, key, scale: float, mask: torch.Tensor) -> torch.Tensor:
    """P, ``[n, Hkv, r * L, Lk]``, from fp32 ``q_blocks`` ``[n, Hkv, r * L, D]`` and ``key``
    ``[n, Hkv, Lk, D]``: scale * Q K^T + M in one ``baddbmm`` (``mask`` ``[r * L, Lk]``, already
    repeated down the r stacked heads, broadcast over the batch), then the softmax."""
    n, kv_heads, rows, dim = q_blocks.shape
    length = key.shape[-2]
    logits = torch.baddbmm(
        mask,
        q_blocks.reshape(n * kv_heads, rows, dim),
        key.reshape(n * kv_heads, length, dim).transpose(1, 2),
        alpha=scale,
    )
    return torch.softmax(logits, dim=-1).view(n, kv_heads, rows, length)


def _fp32(x: torch.Tensor) -> torch.Tensor:
    """``x`` in fp32, contiguous: one copy, whatever its layout (the blocks below are then views)."""
    return x.to(torch.float32, memory_format=torch.contiguous_format).contiguous()


def _model_layout(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp32 ``[n, H, L, D]`` -> ``dtype``, as a ``[n, H, L, D]`` view of a contiguous ``[n, L, H, D]``:
    the layout the projections around attention use, so the transposes and reshapes there (and
    in the grouping's gather and scatter) are views, not copies. One copy, as ``.to(dtype)`` is."""
    n, heads, length, dim = x.shape
    out = torch.empty((n, length, heads, dim), dtype=dtype, device=x.device)
    return out.copy_(x.transpose(1, 2)).transpose(1, 2)


class ShortCausalAttention(torch.autograd.Function):
    """``q`` ``[n, H, L, D]``, ``k`` / ``v`` ``[n, Hkv, L, D]`` -> ``[n, H, L, D]`` (see the module doc)."""

    @staticmethod
    def forward(ctx, query, key, value, scale: float, mask: torch.Tensor):
        n, heads, length, dim = query.shape
        kv_heads = key.shape[1]
        r = heads // kv_heads
        q_blocks = _fp32(query).view(n, kv_heads, r * length, dim)
        probs = _probabilities(q_blocks, _fp32(key), scale, mask)
        out = torch.matmul(probs, _fp32(value))
        ctx.save_for_backward(query, key, value, mask)
        ctx.scale = scale
        return _model_layout(out.view(n, heads, length, dim), query.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        query, key, value, mask = ctx.saved_tensors
        n, heads, length, dim = query.shape
        kv_heads = key.shape[1]
        r = heads // kv_heads
        q_blocks = _fp32(query).view(n, kv_heads, r * length, dim)
        key32 = _fp32(key)
        probs = _probabilities(q_blocks, key32, ctx.scale, mask)
        grad_blocks = _fp32(grad_out).view(n, kv_heads, r * length, dim)
        grad_value = torch.matmul(probs.transpose(-1, -2), grad_blocks)
        grad_probs = torch.matmul(grad_blocks, _fp32(value).transpose(-1, -2))
        # dS = P * (dP - rowsum(P * dP)) * scale: the softmax's own backward kernel (one fused pass)
        grad_scores = torch._softmax_backward_data(grad_probs, probs, -1, torch.float32).mul_(ctx.scale)
        grad_query = torch.matmul(grad_scores, key32).view(n, heads, length, dim)
        grad_key = torch.matmul(grad_scores.transpose(-1, -2), q_blocks)
        grads = (grad_query, grad_key, grad_value)
        return (*(_model_layout(grad, query.dtype) for grad in grads), None, None)


def short_causal_attention(query, key, value, scale: float, window: int | None, batch=None) -> torch.Tensor:
    """Causal (optionally windowed) attention of ``[n, H, L, D]`` by :class:`ShortCausalAttention`
    (keys longer than the queries: a shared prefix before the document's own keys, all visible);
    the mask, stacked once per query head of a key head, is memoised on the batch (one build per
    length, key length, window and head ratio per batch, not one per layer)."""
    length, key_length = query.shape[-2], key.shape[-2]
    heads_per_key = query.shape[1] // key.shape[1]

    def build() -> torch.Tensor:
        return _additive_mask(length, window, query.device, key_length).repeat(heads_per_key, 1)

    if batch is None:
        mask = build()
    else:
        mask = batch.memo(("short_mask", length, key_length, window, heads_per_key, str(query.device)), build)
    return ShortCausalAttention.apply(query, key, value, scale, mask)
