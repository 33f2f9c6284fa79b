"""The ``slipstream_docwise`` backend (``attention_backend="sdpa"``): SDPA within each document,
documents of similar length grouped into one right-padded call (:mod:`..grouping`) or one call each,
every shared prefix handed to its readers (:mod:`.shared_prefix`). Runs everywhere, CPU included."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from ..batch import PackedBatch
from ..costs import ATTENTION_COSTS, BUILTIN
from ..grouping import GROUPING_CHOICE, GROUPING_COUNTS, document_groups, run_grouped
from ..short_attention import SHORT_KERNEL_CHOICE, takes_short_kernel
from .call import _NOT_GIVEN, _fallback_unpacked, _unpack_args
from .documents import _sdpa_one, _sinks_one
from .shared_prefix import _share_prefixes, cpu_context_attention, prefix_readers


def _per_document(fn: Callable, batch: PackedBatch, query, key, value, **kw) -> torch.Tensor:
    """Run ``fn`` on every document and put the row back together: [1, T, H, D], contiguous (for
    several documents one concatenation, a fresh tensor: no copy beyond it).

    ``split`` rather than one slice per document: the backward of a split is a single
    concatenation, while each slice's backward would zero-fill and add a full [1, H, T, D]
    gradient (O(documents x T) work per layer).
    """
    if batch.num_docs == 1:
        return fn(query, key, value, batch=batch, **kw).transpose(1, 2).contiguous()
    lengths = list(batch.seq_lens)
    keys, values = key.split(lengths, 2), value.split(lengths, 2)
    readers = prefix_readers(batch)
    key_prefixes: dict[int, list[torch.Tensor]] = {}
    value_prefixes: dict[int, list[torch.Tensor]] = {}
    if readers:
        # shared context (a pair's prompt, a group's prefix, a tree node's ancestors): the first keys of
        # each source document (a slice of that document's split, not of the row), handed to every
        # document that reads it by one node whose backward sums their gradients in fp32
        # (:class:`_SharedPrefix`); a tree node reads its ancestors' in order, root first
        keys, key_prefixes = _share_prefixes(keys, readers, batch)
        values, value_prefixes = _share_prefixes(values, readers, batch)
    outputs = []
    for number, (q, k, v) in enumerate(zip(query.split(lengths, 2), keys, values, strict=True)):
        if number in key_prefixes:
            out = _context_call(fn, q, key_prefixes[number], value_prefixes[number], k, v, batch, **kw)
            if out is not None:
                outputs.append(out.transpose(1, 2))
                continue
            k = torch.cat([*key_prefixes[number], k], dim=2)
            v = torch.cat([*value_prefixes[number], v], dim=2)
        outputs.append(fn(q, k, v, batch=batch, **kw).transpose(1, 2))
    return torch.cat(outputs, dim=1)


def _context_call(fn, q, context_keys, context_values, k, v, batch, scaling, dropout, window):
    """A document with shared context on a CPU whose call would be a masked SDPA (no dropout, no sinks,
    not the short kernel): :func:`cpu_context_attention`, which keeps no joined copy of the context for
    the backward. None: the caller joins the keys and calls ``fn``."""
    if q.device.type != "cpu" or dropout != 0.0 or getattr(fn, "func", None) is not _sdpa_one:
        return None
    k_len = k.shape[-2] + sum(part.shape[-2] for part in context_keys)
    shape_only = q.new_empty((1, k.shape[1], k_len, 0))  # the short kernel decides on the keys' shape
    mode, costs = (
        fn.keywords.get("short_kernel", "off"),
        fn.keywords.get("costs", BUILTIN),
    )  # _sdpa_one's defaults
    if takes_short_kernel(q, shape_only, dropout, mode, costs):
        return None
    return cpu_context_attention(q, context_keys, context_values, k, v, scaling, window, batch)


def packed_sdpa_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = _NOT_GIVEN,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """SDPA within each document, documents grouped by length or one call each (:mod:`.grouping`).

    query [1, H, T, D], key/value [1, Hkv, T, D] -> [1, T, H, D]."""
    query, batch, scaling, dropout, window, sinks = _unpack_args(
        module, query, key, attention_mask, kwargs, scaling, dropout, sliding_window
    )
    if batch is None:
        return _fallback_unpacked(module, query, key, value, attention_mask, scaling, dropout, window, sinks)
    costs = ATTENTION_COSTS.get(module, BUILTIN)
    if sinks is not None:
        fn = functools.partial(_sinks_one, module, sinks=sinks)
    else:
        fn = functools.partial(_sdpa_one, short_kernel=SHORT_KERNEL_CHOICE.get(module, "auto"), costs=costs)
    kw = {"scaling": scaling, "dropout": dropout, "window": window}
    mode = GROUPING_CHOICE.get(module, "auto")
    if batch.has_prefixes:
        mode = "per_document"  # grouping pads self-attending documents; shared prompts run per document
    groups = document_groups(batch, mode, query.shape[1], key.shape[1], query.shape[-1], costs)
    counts = GROUPING_COUNTS.get(module)
    if counts is not None:
        counts.count(batch, grouped=groups is not None)
    if groups is not None:
        return run_grouped(fn, groups, query, key, value, batch=batch, **kw), None
    return _per_document(fn, batch, query, key, value, **kw), None
