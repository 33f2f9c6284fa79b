"""One linear layer per expert over expert-sorted rows: ``grouped_mm`` or a loop over experts.

Weights are 3D, ``[E, out, in]`` (``transposed=False``, Qwen3-MoE) or ``[E, in, out]``
(``transposed=True``, GPT-OSS). Rows ``x_S`` are sorted by expert; expert e owns the slice
``offsets[e-1]:offsets[e]``.

- ``grouped_mm`` path: one kernel, offsets stay on the device, zero host syncs. Used where
  the platform runs it for the dtype and the 16-byte stride/alignment rule holds.
- loop path: reads the counts to the host once (the only sync of the layer) and loops over
  the experts that received rows. It is one autograd Function, so backward does not
  materialise a full-size weight gradient per indexed expert (what autograd does for
  ``weight[e]`` inside a Python loop), and skips the weight gradient entirely when the
  experts are frozen.
- 4-bit path (``store`` given): the experts that have rows are dequantized a chunk at a
  time and each chunk runs as one grouped matmul; experts without rows are never touched.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..host_reads import read_to_host
from ..refusal import Refusal, optimize_call


class GroupedMmUnavailable(Refusal, RuntimeError):
    """``moe_compute='grouped_mm'`` asked for by name where grouped_mm cannot run these operands."""

    avoid = {"moe_compute": "auto"}  # grouped_mm where it runs, the loop elsewhere


def _grouped_mm_fn():
    fn = getattr(torch.nn.functional, "grouped_mm", None)
    return fn if fn is not None else getattr(torch, "_grouped_mm", None)


def _aligned(t: torch.Tensor) -> bool:
    size = t.element_size()
    return t.data_ptr() % 16 == 0 and all((s * size) % 16 == 0 for s in t.stride() if s != 1)


def grouped_mm_supported(x: torch.Tensor, weight_EIO: torch.Tensor) -> tuple[bool, str]:
    """Can ``grouped_mm`` run these operands here? (answer, reason) — checked without a sync."""
    if _grouped_mm_fn() is None:
        return False, "this torch has no grouped_mm"
    if x.dtype != weight_EIO.dtype:
        return False, f"mixed dtypes {x.dtype}/{weight_EIO.dtype}"
    if x.device.type == "cuda":
        if torch.cuda.get_device_capability(x.device) < (8, 0):
            return False, "grouped_mm needs compute capability 8.0+"
        if x.dtype != torch.bfloat16:
            return False, f"CUDA grouped_mm runs bfloat16, not {x.dtype}"
    elif x.device.type != "cpu":
        return False, f"no grouped_mm on {x.device.type}"
    if not (_aligned(x) and _aligned(weight_EIO)):
        return False, "operands break the 16-byte stride/alignment rule"
    # The output and, in backward, its gradient have rows of the weight's other dimension: both
    # matrix dimensions must be whole 16-byte multiples (a rank-4 bf16 LoRA factor is not).
    if any(dim * weight_EIO.element_size() % 16 for dim in weight_EIO.shape[-2:]):
        return (
            False,
            "a weight dimension is not a multiple of 16 bytes (its output rows would break the rule)",
        )
    return True, "grouped_mm"


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the gradient contiguous: grouped_mm's backward fails on a
    stride-0 (expanded) gradient, which e.g. ``out.sum().backward()`` produces."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


def grouped_mm_linear(x_S: torch.Tensor, weight: torch.Tensor, offsets_E: torch.Tensor, transposed: bool):
    """``x_S @ W_e`` for every expert slice in one grouped_mm call (no bias)."""
    weight_EIO = weight if transposed else weight.transpose(-2, -1)
    out = _grouped_mm_fn()(x_S, weight_EIO, offs=offsets_E)
    return _ContiguousGrad.apply(out)


class _LoopGroupedLinear(torch.autograd.Function):
    """Per-expert ``x_e @ W_e + b_e`` over host-side ``counts``; see the module docstring."""

    @staticmethod
    def forward(ctx, x_S, weight, bias, counts: Sequence[int], transposed: bool):
        ctx.counts, ctx.transposed = counts, transposed
        ctx.save_for_backward(x_S, weight, bias)
        pieces = []
        for expert, rows in _nonempty(counts):
            x_e, w = x_S[rows], weight[expert]
            y = x_e @ w if transposed else x_e @ w.T
            if bias is not None:
                y = y + bias[expert]
            pieces.append(y)
        out_features = weight.shape[-1] if transposed else weight.shape[-2]
        return torch.cat(pieces) if pieces else x_S.new_zeros(0, out_features)

    @staticmethod
    def backward(ctx, grad_S):
        x_S, weight, bias = ctx.saved_tensors
        counts, transposed = ctx.counts, ctx.transposed
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        grad_S = grad_S.contiguous()
        grad_x = torch.empty_like(x_S) if need_x else None
        grad_w = torch.zeros_like(weight) if need_w else None
        grad_b = torch.zeros_like(bias) if need_b else None
        for expert, rows in _nonempty(counts):
            g = grad_S[rows]
            if need_x:
                w = weight[expert]
                grad_x[rows] = g @ w.T if transposed else g @ w
            if need_w:
                x_e = x_S[rows]
                grad_w[expert] = x_e.T @ g if transposed else g.T @ x_e
            if need_b:
                grad_b[expert] = g.sum(0)
        if need_x:
            grad_x[sum(counts) :] = 0  # rows past every expert's (none when the counts cover x_S)
        return grad_x, grad_w, grad_b, None, None


def _nonempty(counts: Sequence[int]):
    """(expert, the slice of its rows) of every expert that has rows, in order."""
    start = 0
    for expert, count in enumerate(counts):
        if count:
            yield expert, slice(start, start + count)
            start += count


def _chunks(counts: Sequence[int], experts_per_chunk: int):
    """(expert ids, first row, end row, their counts) of consecutive chunks of non-empty experts."""
    hit = [(expert, count) for expert, count in enumerate(counts) if count]
    row = 0
    for i in range(0, len(hit), experts_per_chunk):
        chunk = hit[i : i + experts_per_chunk]
        rows = sum(count for _, count in chunk)
        yield [e for e, _ in chunk], row, row + rows, [c for _, c in chunk]
        row += rows


def _chunk_matmul(x: torch.Tensor, weight_GIO: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """Rows of ``len(counts)`` consecutive groups times their [in, out] weights."""
    if grouped_mm_supported(x, weight_GIO)[0]:
        offsets = torch.tensor(counts, dtype=torch.int32).cumsum(0, dtype=torch.int32)
        return _grouped_mm_fn()(x, weight_GIO, offs=offsets.to(x.device, non_blocking=True))
    return torch.cat([x_g @ weight_GIO[g] for g, x_g in enumerate(x.split(counts))])


class _QuantizedGroupedLinear(torch.autograd.Function):
    """Frozen 4-bit experts: dequantize the experts that have rows, a chunk at a time, and run
    each chunk as one grouped matmul. Backward dequantizes again instead of keeping the dense
    weights alive between forward and backward (the memory QLoRA is for)."""

    @staticmethod
    def forward(ctx, x_S, counts, transposed, store, experts_per_chunk):
        ctx.counts, ctx.transposed = counts, transposed
        ctx.store, ctx.experts_per_chunk = store, experts_per_chunk
        shape = store.weight_shape
        out = x_S.new_zeros(x_S.shape[0], shape[-1] if transposed else shape[-2])
        for experts, start, end, chunk_counts in _chunks(counts, experts_per_chunk):
            weight = store.dequantize_many(torch.tensor(experts, device=x_S.device), x_S.dtype)
            weight_GIO = weight if transposed else weight.transpose(-2, -1)
            out[start:end] = _chunk_matmul(x_S[start:end], weight_GIO, chunk_counts)
        return out

    @staticmethod
    def backward(ctx, grad_S):
        store, transposed = ctx.store, ctx.transposed
        grad_S = grad_S.contiguous()
        shape = store.weight_shape
        grad_x = grad_S.new_zeros(grad_S.shape[0], shape[-2] if transposed else shape[-1])
        for experts, start, end, chunk_counts in _chunks(ctx.counts, ctx.experts_per_chunk):
            weight = store.dequantize_many(torch.tensor(experts, device=grad_S.device), grad_S.dtype)
            weight_GOI = weight.transpose(-2, -1) if transposed else weight
            grad_x[start:end] = _chunk_matmul(grad_S[start:end], weight_GOI, chunk_counts)
        return grad_x, None, None, None, None


def quantized_linear(x_S, store, counts: Sequence[int], transposed: bool, chunk_bytes: int = 256 << 20):
    """``x_e @ dequant(W_e)`` for every expert with rows; at most ``chunk_bytes`` of dense weights at once.

    ``store`` hands out the dense weights of chosen experts: ``weight_shape`` and
    ``dequantize_many(experts, dtype)``."""
    _, a, b = store.weight_shape
    experts_per_chunk = max(1, chunk_bytes // (a * b * x_S.element_size()))
    return _QuantizedGroupedLinear.apply(x_S, counts, transposed, store, experts_per_chunk)


class GroupedLinear:
    """Chooses the path once per layer call and runs every projection of the layer on it."""

    def __init__(self, x_S: torch.Tensor, weight: torch.Tensor | None, counts_E, offsets_E, compute: str):
        self.counts_E, self.offsets_E = counts_E, offsets_E
        self.path = "loop"
        self.reason = "requested" if compute == "loop" else "4-bit experts: chunked dequantization"
        if compute in ("auto", "grouped_mm") and weight is not None:
            ok, reason = grouped_mm_supported(x_S, weight)
            if ok:
                self.path, self.reason = "grouped_mm", reason
            elif compute == "grouped_mm":
                raise GroupedMmUnavailable(
                    f"moe_compute='grouped_mm' cannot run here: {reason}. "
                    f"Use {optimize_call(GroupedMmUnavailable.avoid)}",
                    refused=f"moe_compute='grouped_mm' here ({reason})",
                )
            else:
                self.reason = reason
        self._counts: list[int] | None = None

    @property
    def counts(self) -> list[int]:
        if self._counts is None:
            self._counts = read_to_host(self.counts_E)  # the loop path's one sync per layer
        return self._counts

    def __call__(self, x_S, weight, bias, transposed: bool, store=None, expert_ids_S=None) -> torch.Tensor:
        if store is not None:
            out = quantized_linear(x_S, store, self.counts, transposed)
        elif self.path == "grouped_mm" and grouped_mm_supported(x_S, weight)[0]:
            out = grouped_mm_linear(x_S, weight, self.offsets_E, transposed)
        else:
            return _LoopGroupedLinear.apply(x_S, weight, bias, self.counts, transposed)
        return out if bias is None else out + bias.index_select(0, expert_ids_S)
