"""Documents of a packed row grouped by length, so the SDPA path makes a few calls, not one each.

The per-document SDPA path (``slipstream_docwise``) calls ``scaled_dot_product_attention`` once
per document per layer. Each call has a fixed cost (dispatch, a parallel region per kernel,
autograd nodes in backward). Grouping puts documents of similar length side by side, each
right-padded to its group's longest, and runs one batched SDPA per group ``[n, H, L, D]``,
at the price of one gather of q / k / v and one scatter of the output (and their backwards)
and of the padding's score FLOPs.

Exact: with causal attention, a right-padded document's real queries never see the padding
after them (``is_causal=True``, or the window mask, aligned at each document's start), and the
padding queries' outputs are dropped by the scatter, so their gradient is exactly zero and
adds nothing to the real positions' ``dq / dk / dv``. Sliding windows, sinks and chunked
attention (a chunked row is its own batch of pieces, :meth:`PackedBatch.split_every`) are
handled the same way as per document.

The plan (which document goes where, the gather and scatter indices) is built once per batch
(and attention shape) from the host lengths and memoised on the batch, so every layer reuses
it and nothing is read back from the device.

What "auto" chose is counted (:class:`GroupingCounts`, one per optimized model, on
``OptimizeState.grouping_counts``): batches and attention calls that ran grouped or one call per
document. Plain Python integers, bumped where the plan is looked up: no device work, the same on
every machine.

The rule ("auto") is a cost model (:class:`.costs.AttentionCosts`) with three timings: a call's
fixed cost, a score element's per head and head dimension, and an element moved by the gather and
scatter. On a CPU ``optimize`` hands each model the ones :mod:`.calibration` measured on this
device, dtype and thread count; the built-in ones (:data:`.costs.BUILTIN`) were measured with
``benchmarks/doc_attention.py`` on this project's 2-core CPU (fp32, 2 threads, best of the
repeats; forward + backward):

- a call costs 0.1 ms (128 documents of 8 tokens, 4 / 2 heads of 32: 15.3 ms one call each,
  2.1 ms grouped);
- a score element costs 1.5e-10 s per head and head dimension (12 documents of ~85 tokens,
  16 / 8 heads of 128: 29.2 ms one call each);
- the gather and scatter cost 6e-10 s per element of q, k, v and the output (the same row
  grouped in 2 calls with 12% padding: 35.1 ms, 3.6 ms of it moving data).

The groups are the cheapest split of the documents, taken in length order, under that model
(a dynamic program over the distinct lengths); "auto" groups when that plan's modelled cost,
gather included, is below one call per document. So Qwen3-0.6B-shaped layers (16 heads of
128) on ~90-token chat rows stay per document (grouped measured 0.78x fp32, 0.91x bf16 there:
the FLOPs dominate, not the calls), while many short documents, or small heads, are grouped.

Not modelled: a CPU shared with other processes. There every parallel region can wait for a
descheduled thread, so each call costs far more (the same chat row: ~0.9 s at 2 threads against
~50 ms at 1), and grouping measured 1.1-1.5x on the Qwen3-0.6B-shaped row and ~2x tokens/s on
the demo model's A/B; one thread (``slipstream ab --threads 1``) is the better cure there.
``attention_grouping="grouped"`` forces the groups.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Literal

import torch

from .batch import PackedBatch, host_tensor
from .costs import BUILTIN, AttentionCosts

# The grouping choices, defined once (Speedups and the CLIs read them).
AttentionGrouping = Literal["auto", "grouped", "per_document"]


def rule(costs: AttentionCosts = BUILTIN) -> str:
    """What "auto" does under ``costs``, in words (the policy line)."""
    return (
        "documents grouped by length into batched SDPA calls where a cost model (a call "
        f"{costs.call_seconds * 1e3:.3g} ms, a score element {costs.score_seconds:.2g} s per head and dim, the "
        f"gather; {costs.source}) says it is cheaper than one call per document"
    )


RULE = rule()

# Per attention-module setting, kept beside the modules (weak keys: a module that goes away
# takes its entry with it); a module without an entry runs "auto".
GROUPING_CHOICE: weakref.WeakKeyDictionary[torch.nn.Module, str] = weakref.WeakKeyDictionary()


@dataclass(eq=False)  # hashed by identity: a batch's memo key names the counter that counted it
class GroupingCounts:
    """How a model's packed SDPA attention ran: batches and attention calls, grouped or one call
    per document.

    ``calls_*``: attention calls (one per attention layer per forward; a recomputed forward in
    backward counts again). ``batches_*``: packed batches (a chunked row's pieces are one batch
    each), counted at the batch's first attention call. A batch of one document runs one call per
    document, as "per_document" does."""

    batches_grouped: int = 0
    batches_per_document: int = 0
    calls_grouped: int = 0
    calls_per_document: int = 0

    def count(self, batch: PackedBatch, grouped: bool) -> None:
        """One attention call on ``batch``; the batch itself once (memoised on it)."""
        if grouped:
            self.calls_grouped += 1
        else:
            self.calls_per_document += 1
        batch.memo(("grouping_counted", self), lambda: self._count_batch(grouped))

    def _count_batch(self, grouped: bool) -> bool:
        if grouped:
            self.batches_grouped += 1
        else:
            self.batches_per_document += 1
        return True

    def reset(self) -> None:
        self.batches_grouped = self.batches_per_document = self.calls_grouped = self.calls_per_document = 0

    def to_dict(self) -> dict[str, int]:
        return dict(vars(self))

    def describe(self) -> str:
        """One line: "grouped 38 of 40 batches (456 of 480 attention calls)"."""
        return describe_counts(self.to_dict())


def describe_counts(counts: dict[str, int]) -> str:
    """:meth:`GroupingCounts.describe` of a recorded ``to_dict()``."""
    batches = counts["batches_grouped"] + counts["batches_per_document"]
    calls = counts["calls_grouped"] + counts["calls_per_document"]
    return (
        f"grouped {counts['batches_grouped']} of {batches} batches "
        f"({counts['calls_grouped']} of {calls} attention calls)"
    )


# The model's counter for each of its modules (set by optimize beside GROUPING_CHOICE).
GROUPING_COUNTS: weakref.WeakKeyDictionary[torch.nn.Module, GroupingCounts] = weakref.WeakKeyDictionary()


def grouping_policy(mode: str, backend: str, has_sinks: bool, costs: AttentionCosts = BUILTIN) -> str:
    """The policy line for ``mode`` on ``backend`` (what optimize logs)."""
    if backend != "sdpa" and not has_sinks:
        return f"{mode} (unused: the {backend} backend attends the whole row in one call)"
    if mode == "per_document":
        return "per_document (one SDPA call per document)"
    if mode == "grouped":
        return "grouped (documents grouped by length into batched SDPA calls, the cheapest split by the cost model)"
    return f"auto ({rule(costs)})"


@dataclass(frozen=True, eq=False)
class DocumentGroups:
    """A row's documents in groups of one padded length each.

    ``shapes``: ``(documents, padded length)`` per group, in gather order. Indices (``[P]`` with
    ``P = sum n * L`` slots, ``[T]`` for the row): ``gather_index`` ``[P]``, the row position each
    slot reads (a padding slot reads its document's first token; its output is dropped);
    ``scatter_index`` ``[T]``, the slot each row position's output comes from;
    ``gather_or_zero`` ``[P]``, as ``gather_index`` but a padding slot reads row ``T`` (a zero row
    appended to the gradient, so padding queries get a zero gradient).
    """

    shapes: tuple[tuple[int, int], ...]
    gather_index: torch.Tensor
    scatter_index: torch.Tensor
    gather_or_zero: torch.Tensor
    real_elements: int  # sum Li^2
    padded_elements: int  # sum n * L^2


def plan_groups(seq_lens: tuple[int, ...], call_elements: float) -> tuple[list[list[int]], float]:
    """The cheapest grouping of ``seq_lens`` and its cost, in score elements.

    A group costs ``call_elements`` (one call's fixed cost, in score elements) plus its padded
    score elements (each document costs its group's longest length squared). Groups are ranges
    of the distinct lengths in order (an optimal split never interleaves them): a dynamic
    program over at most ~sqrt(2T) distinct lengths. Returns document indices per group,
    longest group first.
    """
    distinct = sorted(set(seq_lens))
    counts = {length: 0 for length in distinct}
    for length in seq_lens:
        counts[length] += 1
    m = len(distinct)
    before = [0]  # documents with the first i distinct lengths
    for length in distinct:
        before.append(before[-1] + counts[length])
    best = [0.0] + [float("inf")] * m  # best[j]: the j shortest distinct lengths
    cut = [0] * (m + 1)
    for j in range(1, m + 1):
        square = distinct[j - 1] ** 2
        for i in range(j):
            cost = best[i] + call_elements + (before[j] - before[i]) * square
            if cost < best[j]:
                best[j], cut[j] = cost, i
    groups, j = [], m
    while j:
        wanted = set(distinct[cut[j] : j])
        groups.append([d for d, length in enumerate(seq_lens) if length in wanted])
        j = cut[j]
    return groups, best[m]


def document_groups(
    batch: PackedBatch, mode: str, heads: int, kv_heads: int, head_dim: int, costs: AttentionCosts = BUILTIN
) -> DocumentGroups | None:
    """The batch's groups for ``mode`` ("auto", "grouped") and this attention shape, or None
    for one call per document (``costs``: the cost model "auto" weighs). Built once per batch,
    shape and cost model from the host lengths, memoised."""
    if mode == "per_document" or batch.num_docs == 1:
        return None
    key = ("document_groups", mode, heads, kv_heads, head_dim, costs)
    return batch.memo(key, lambda: _build(batch, mode, heads, kv_heads, head_dim, costs))


def _build(
    batch: PackedBatch, mode: str, heads: int, kv_heads: int, head_dim: int, costs: AttentionCosts
) -> DocumentGroups | None:
    seq_lens = batch.seq_lens
    element = costs.score_seconds * heads * head_dim  # seconds per score element
    call_elements = costs.call_seconds / element
    plan, grouped_cost = plan_groups(seq_lens, call_elements)
    gather_elements = (
        costs.gather_seconds * batch.num_tokens * (2 * heads + 2 * kv_heads) * head_dim / element
    )
    per_document_cost = len(seq_lens) * call_elements + sum(length * length for length in seq_lens)
    if mode == "auto" and grouped_cost + gather_elements >= per_document_cost:
        return None
    starts = [start for start, _ in batch.doc_bounds()]
    T = batch.num_tokens
    gather: list[int] = []
    gather_or_zero: list[int] = []
    scatter = [0] * T
    shapes = []
    for docs in plan:
        longest = max(seq_lens[d] for d in docs)
        shapes.append((len(docs), longest))
        for d in docs:
            start, length = starts[d], seq_lens[d]
            slot = len(gather)
            scatter[start : start + length] = range(slot, slot + length)
            gather += range(start, start + length)
            gather += [start] * (longest - length)
            gather_or_zero += range(start, start + length)
            gather_or_zero += [T] * (longest - length)
    return DocumentGroups(
        shapes=tuple(shapes),
        gather_index=host_tensor(gather, batch.device),
        scatter_index=host_tensor(scatter, batch.device),
        gather_or_zero=host_tensor(gather_or_zero, batch.device),
        real_elements=sum(length * length for length in seq_lens),
        padded_elements=sum(n * length * length for n, length in shapes),
    )


class _ToSlots(torch.autograd.Function):
    """``x_T`` ``[T, ...]`` -> ``x_P`` ``[P, ...]`` (each document's tokens then its padding).

    Backward reads each position's gradient from its own slot (one index_select; no zero-filled
    ``[T, ...]`` and no index_add): a padding slot's gradient is exactly zero (its query's output
    is dropped, and no real query sees its key), so leaving it out changes nothing."""

    @staticmethod
    def forward(ctx, x_T, groups):
        ctx.groups = groups
        return x_T.index_select(0, groups.gather_index)

    @staticmethod
    def backward(ctx, grad_P):
        return grad_P.index_select(0, ctx.groups.scatter_index), None


class _FromSlots(torch.autograd.Function):
    """``x_P`` ``[P, ...]`` -> ``x_T`` ``[1, T, ...]``: the real slots, in row order, as the row.

    A fresh tensor, not a view (as the per-document path returns): a compiled layer's graph
    after the attention then sees the same kind of input whichever path ran, and does not
    recompile for it. Backward: each slot's gradient from its row position, zero for padding
    slots (so padding queries contribute nothing to any real position's gradient)."""

    @staticmethod
    def forward(ctx, x_P, groups):
        ctx.groups = groups
        return x_P.unsqueeze(0).index_select(1, groups.scatter_index)

    @staticmethod
    def backward(ctx, grad_row):
        grad_T = grad_row[0]
        padded = torch.cat([grad_T, grad_T.new_zeros((1, *grad_T.shape[1:]))])
        return padded.index_select(0, ctx.groups.gather_or_zero), None


def run_grouped(fn, groups: DocumentGroups, query, key, value, **kw) -> torch.Tensor:
    """``fn`` (``[n, H, L, D]`` in and out) once per group; returns the row's output ``[1, T, H, D]``.

    query ``[1, H, T, D]``, key / value ``[1, Hkv, T, D]``. One gather per input and one
    scatter for the output (their backwards: one index_select each), whatever the group count.
    """
    slots = [n * length for n, length in groups.shapes]
    gathered = [_ToSlots.apply(t[0].transpose(0, 1), groups).split(slots) for t in (query, key, value)]
    outputs = []
    for (n, length), q, k, v in zip(groups.shapes, *gathered, strict=True):
        q, k, v = (t.view(n, length, *t.shape[1:]).transpose(1, 2) for t in (q, k, v))
        out = fn(q, k, v, **kw)  # [n, H, L, D]
        heads, dim = out.shape[1], out.shape[3]
        outputs.append(out.transpose(1, 2).reshape(n * length, heads, dim))
    out_PHD = outputs[0] if len(outputs) == 1 else torch.cat(outputs)
    return _FromSlots.apply(out_PHD, groups)
