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
  experts are frozen. A ``weight_store`` (e.g. 4-bit experts) hands out each expert's
  weight on demand, so only experts with rows are ever dequantized.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from ..bench.counters import read_to_host


class ExpertWeightStore(Protocol):
    """Hands out one expert's dense weight (in the layer's layout) when asked."""

    def expert_weight(self, expert: int, dtype: torch.dtype) -> torch.Tensor: ...


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


def _dense(weight, store, expert: int, dtype) -> torch.Tensor:
    return weight[expert] if store is None else store.expert_weight(expert, dtype)


class _LoopGroupedLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_S, weight, bias, counts: Sequence[int], transposed: bool, store):
        ctx.counts, ctx.transposed, ctx.store = counts, transposed, store
        ctx.save_for_backward(x_S, weight, bias)
        pieces = []
        for expert, x_e in _nonempty(counts, x_S):
            w = _dense(weight, store, expert, x_S.dtype)
            y = x_e @ w if transposed else x_e @ w.T
            if bias is not None:
                y = y + bias[expert]
            pieces.append(y)
        out_features = bias.shape[-1] if bias is not None else _out_features(weight, store, transposed)
        return torch.cat(pieces) if pieces else x_S.new_zeros(0, out_features)

    @staticmethod
    def backward(ctx, grad_S):
        x_S, weight, bias = ctx.saved_tensors
        counts, transposed, store = ctx.counts, ctx.transposed, ctx.store
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        grad_S = grad_S.contiguous()
        grad_x = torch.empty_like(x_S) if need_x else None
        grad_w = torch.zeros_like(weight) if need_w else None
        grad_b = torch.zeros_like(bias) if need_b else None
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            g = grad_S[start : start + count]
            if need_x:
                w = _dense(weight, store, expert, g.dtype)
                grad_x[start : start + count] = g @ w.T if transposed else g @ w
            if need_w:
                x_e = x_S[start : start + count]
                grad_w[expert] = x_e.T @ g if transposed else g.T @ x_e
            if need_b:
                grad_b[expert] = g.sum(0)
            start += count
        if need_x and start < x_S.shape[0]:
            grad_x[start:] = 0
        return grad_x, grad_w, grad_b, None, None, None


def _nonempty(counts: Sequence[int], x_S: torch.Tensor):
    start = 0
    for expert, count in enumerate(counts):
        if count:
            yield expert, x_S[start : start + count]
            start += count


def _out_features(weight, store, transposed: bool) -> int:
    shape = weight.shape if weight is not None else store.weight_shape
    return shape[-1] if transposed else shape[-2]


def loop_linear(
    x_S: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    counts: Sequence[int],
    transposed: bool,
    store: ExpertWeightStore | None = None,
) -> torch.Tensor:
    """Per-expert ``x_e @ W_e + b_e`` over host-side ``counts``; see the module docstring."""
    return _LoopGroupedLinear.apply(x_S, weight, bias, counts, transposed, store)


class GroupedLinear:
    """Chooses the path once per layer call and runs every projection of the layer on it."""

    def __init__(self, x_S: torch.Tensor, weight: torch.Tensor | None, counts_E, offsets_E, compute: str):
        self.counts_E, self.offsets_E = counts_E, offsets_E
        self.path, self.reason = "loop", compute
        if compute in ("auto", "grouped_mm") and weight is not None:
            ok, reason = grouped_mm_supported(x_S, weight)
            if ok:
                self.path, self.reason = "grouped_mm", reason
            elif compute == "grouped_mm":
                raise RuntimeError(f"moe_compute='grouped_mm' cannot run here: {reason}")
            else:
                self.reason = reason
        self._counts: list[int] | None = None

    @property
    def counts(self) -> list[int]:
        if self._counts is None:
            self._counts = read_to_host(self.counts_E)  # the loop path's one sync per layer
        return self._counts

    def __call__(self, x_S, weight, bias, transposed: bool, store=None, expert_ids_S=None) -> torch.Tensor:
        if self.path == "grouped_mm" and store is None and grouped_mm_supported(x_S, weight)[0]:
            out = grouped_mm_linear(x_S, weight, self.offsets_E, transposed)
            if bias is not None:
                out = out + bias.index_select(0, expert_ids_S)
            return out
        return loop_linear(x_S, weight, bias, self.counts, transposed, store)
