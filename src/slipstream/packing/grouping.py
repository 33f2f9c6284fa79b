"""Documents of a packed row grouped by length, so the SDPA path makes a few calls, not one each.

The per-document SDPA path (``slipstream_docwise``) calls ``scaled_dot_product_attention`` once
per document per layer. On a CPU, with short chat rows (~11 documents of ~90 tokens in a
1024-token row), each call's fixed cost (thread start-up and join, dispatch; autograd nodes in
backward) outweighs its FLOPs. Grouping puts documents of similar length side by side, each
right-padded to its group's longest, and runs one batched SDPA per group ``[n, H, L, D]``.

Exact: with causal attention, a right-padded document's real queries never see the padding
after them (``is_causal=True``, or the window mask, aligned at each document's start), and the
padding queries' outputs are dropped by the scatter, so their gradient is exactly zero and
adds nothing to the real positions' ``dq / dk / dv``. Sliding windows, sinks and chunked
attention (a chunked row is its own batch of pieces, :meth:`PackedBatch.split_every`) are
handled the same way as per document.

The plan (which document goes where, the gather and scatter indices) is built once per batch
from the host lengths and memoised on the batch, so every layer reuses it and nothing is read
back from the device.

The rule ("auto"), from ``benchmarks/doc_attention.py`` on a 2-core CPU (see the module's
measured figures in :data:`RULE`): the fewest groups (at most :data:`MAX_GROUPS`) whose padding
adds at most :data:`MAX_PADDING` of the row's real score FLOPs (sum of Li^2); grouped when that
plan makes at most half as many calls as there are documents, per document otherwise.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Literal, get_args

import torch

from .batch import PackedBatch

# The grouping choices, defined once (Speedups and the CLIs read them).
AttentionGrouping = Literal["auto", "grouped", "per_document"]
GROUPINGS: tuple[str, ...] = get_args(AttentionGrouping)
MAX_GROUPS = 8  # calls per row at most (per layer)
MAX_PADDING = 0.25  # padded score elements / real score elements - 1, at most
MIN_DOCS_PER_CALL = 2.0  # "auto" groups only when a call carries this many documents on average
RULE = (
    f"documents grouped by length into at most {MAX_GROUPS} SDPA calls per row, padding <= "
    f"{MAX_PADDING:.0%} extra score FLOPs, when that makes <= 1/{MIN_DOCS_PER_CALL:g} the calls "
    "(else one call per document)"
)

# Per attention-module setting, kept beside the modules (weak keys: a module that goes away
# takes its entry with it); a module without an entry runs "auto".
GROUPING_CHOICE: weakref.WeakKeyDictionary[torch.nn.Module, str] = weakref.WeakKeyDictionary()


def grouping_policy(mode: str, backend: str, has_sinks: bool) -> str:
    """The policy line for ``mode`` on ``backend`` (what optimize logs)."""
    if backend != "sdpa" and not has_sinks:
        return f"{mode} (unused: the {backend} backend attends the whole row in one call)"
    if mode == "per_document":
        return "per_document (one SDPA call per document)"
    if mode == "grouped":
        return f"grouped (documents grouped by length, at most {MAX_GROUPS} calls where padding <= {MAX_PADDING:.0%})"
    return f"auto ({RULE})"


@dataclass(frozen=True, eq=False)
class DocumentGroups:
    """A row's documents in groups of one padded length each.

    ``shapes``: ``(documents, padded length)`` per group, in gather order. ``gather_index``
    ``[P]`` (``P = sum n * L``): the row position each padded slot reads (a padding slot reads
    its document's first token, whose output is dropped). ``scatter_index`` ``[T]``: the slot
    each row position's output comes from.
    """

    shapes: tuple[tuple[int, int], ...]
    gather_index: torch.Tensor
    scatter_index: torch.Tensor
    real_elements: int  # sum Li^2
    padded_elements: int  # sum n * L^2

    @property
    def slots(self) -> list[int]:
        return [n * length for n, length in self.shapes]


def plan_groups(
    seq_lens: tuple[int, ...], max_groups: int = MAX_GROUPS, max_padding: float = MAX_PADDING
) -> list[list[int]] | None:
    """Document indices per group (longest group first), or None if no plan fits the bounds.

    The fewest groups of documents adjacent in length order whose padded score elements
    (each document costs its group's longest length squared) stay within ``1 + max_padding``
    of the real ones. A dynamic program over the distinct lengths (at most ~sqrt(2T) of them).
    """
    distinct = sorted(set(seq_lens))
    counts = {length: 0 for length in distinct}
    for length in seq_lens:
        counts[length] += 1
    m = len(distinct)
    before = [0]  # documents with the first i distinct lengths
    for length in distinct:
        before.append(before[-1] + counts[length])
    real = sum(length * length for length in seq_lens)
    budget = (1 + max_padding) * real
    inf = float("inf")
    # best[j]: least padded elements covering the j shortest distinct lengths with k groups
    best = [0.0] + [inf] * m
    cuts: list[list[int]] = []
    for _ in range(min(max_groups, m)):
        new, cut = [inf] * (m + 1), [0] * (m + 1)
        for j in range(1, m + 1):
            square = distinct[j - 1] ** 2
            for i in range(j):
                if best[i] == inf:
                    continue
                cost = best[i] + (before[j] - before[i]) * square
                if cost < new[j]:
                    new[j], cut[j] = cost, i
        best = new
        cuts.append(cut)
        if best[m] <= budget:
            break
    else:
        return None
    # walk the cuts back: ranges of distinct lengths, shortest last in the list built
    ranges, j = [], m
    for cut in reversed(cuts):
        i = cut[j]
        ranges.append(distinct[i:j])
        j = i
    groups = []
    for lengths in ranges:  # longest range first
        wanted = set(lengths)
        groups.append([d for d, length in enumerate(seq_lens) if length in wanted])
    return groups


def _device_index(values: list[int], device: torch.device) -> torch.Tensor:
    index = torch.tensor(values, dtype=torch.long)
    if device.type != "cpu":
        pinned = index.pin_memory() if torch.cuda.is_available() else index
        index = pinned.to(device, non_blocking=True)
    return index


def document_groups(batch: PackedBatch, mode: str) -> DocumentGroups | None:
    """The batch's groups for ``mode`` ("auto", "grouped"), or None for one call per document.

    Built once per batch (and mode) from the host lengths, memoised on the batch.
    """
    if mode == "per_document" or batch.num_docs == 1:
        return None
    return batch.memo(("document_groups", mode), lambda: _build(batch, mode))


def _build(batch: PackedBatch, mode: str) -> DocumentGroups | None:
    seq_lens = batch.seq_lens
    plan = plan_groups(seq_lens)
    if plan is None:
        if mode != "grouped":
            return None
        plan = plan_groups(seq_lens, max_groups=len(seq_lens))  # one length a group: no padding
        assert plan is not None
    if mode == "auto" and len(seq_lens) < MIN_DOCS_PER_CALL * len(plan):
        return None
    starts = [start for start, _ in batch.doc_bounds()]
    gather: list[int] = []
    scatter = [0] * batch.num_tokens
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
    return DocumentGroups(
        shapes=tuple(shapes),
        gather_index=_device_index(gather, batch.device),
        scatter_index=_device_index(scatter, batch.device),
        real_elements=sum(length * length for length in seq_lens),
        padded_elements=sum(n * length * length for n, length in shapes),
    )


def run_grouped(fn, groups: DocumentGroups, query, key, value, **kw) -> torch.Tensor:
    """``fn`` (``[n, H, L, D]`` in and out) once per group; returns the row's output ``[1, T, H, D]``.

    query ``[1, H, T, D]``, key / value ``[1, Hkv, T, D]``. One gather per input and one
    scatter for the output (their backwards: one index_add each), whatever the group count.
    """
    slots = groups.slots
    gathered = [
        t[0].transpose(0, 1).index_select(0, groups.gather_index).split(slots) for t in (query, key, value)
    ]
    outputs = []
    for (n, length), q, k, v in zip(groups.shapes, *gathered, strict=True):
        q, k, v = (t.view(n, length, *t.shape[1:]).transpose(1, 2) for t in (q, k, v))
        out = fn(q, k, v, **kw)  # [n, H, L, D]
        heads, dim = out.shape[1], out.shape[3]
        outputs.append(out.transpose(1, 2).reshape(n * length, heads, dim))
    out_PHD = outputs[0] if len(outputs) == 1 else torch.cat(outputs)
    return out_PHD.index_select(0, groups.scatter_index).unsqueeze(0)
