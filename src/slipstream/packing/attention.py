"""Packed attention backends, registered with transformers' ``AttentionInterface``.

Each backend reads the :class:`PackedBatch` that rides along in the model's ``**kwargs`` and
attends within each document only. Nothing here builds a [T, T] mask or reads a device value
back to the host: document boundaries are Python ints on the batch, and anything derived
from them (small per-document masks, a flex BlockMask) is memoised on that batch.

Backends (``config._attn_implementation`` names):

- ``slipstream_docwise`` (backend "sdpa"): ``scaled_dot_product_attention`` within each document, so
  attention costs O(sum Li^2) instead of O(T^2). Works everywhere (CPU included). Documents of
  similar length share one batched call, right-padded (:mod:`.grouping`, the ``attention_grouping``
  speedup), or take one call each. On a CPU a short document (or group) takes two GEMMs and an
  fp32 softmax instead of SDPA's flash kernel (:mod:`.short_attention`, ``short_document_kernel``).
- ``slipstream_varlen``: one varlen flash-attention call for the whole row
  (``torch.nn.attention.varlen.varlen_attn``, or flash-attn's ``flash_attn_varlen_func``). CUDA.
  A row with shared prefixes (preference pairs, prefix groups) takes two calls of torch's kernel
  merged by their log-sum-exps (:class:`_PrefixedVarlen`), or per-document SDPA where a sliding
  window cuts a sequence or only flash-attn is installed.
- ``slipstream_flex``: ``flex_attention`` with a document-causal BlockMask built once per batch
  (shared prefixes and sliding windows included).

Attention sinks (GPT-OSS) take a per-document eager path on every backend, since none of the
fused kernels above implements them; it is still O(sum Li^2) and still mask-free at T x T.
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable
from typing import Any, Literal, get_args

import torch
import torch.nn.functional as F

from ..refusal import Refusal, optimize_call
from .batch import PackedBatch, cumulative
from .costs import ATTENTION_COSTS, BUILTIN
from .grouping import GROUPING_CHOICE, GROUPING_COUNTS, document_groups, run_grouped
from .guards import UNPACKED, UnsupportedArchitecture, check_attention_call, layer_name
from .rowpos import document_temperature
from .short_attention import SHORT_KERNEL_CHOICE, short_causal_attention, takes_short_kernel

# The packed-attention backends, defined once (Speedups and the CLIs read them).
AttentionBackend = Literal["auto", "sdpa", "varlen", "flex"]
BACKENDS = tuple(b for b in get_args(AttentionBackend) if b != "auto")
_NOT_GIVEN: Any = object()  # an attention call that did not pass sliding_window at all (None: no window)


class UnsupportedAttentionFeature(Refusal, NotImplementedError):
    """A model asks for an attention feature the packed backends do not implement."""

    avoid = {"packed_attention": False}


class AttentionBackendUnavailable(Refusal, ValueError):
    """An ``attention_backend`` asked for by name that cannot run here (the device, the dtype)."""

    avoid = {"attention_backend": "auto"}


_SDPA = {"attention_backend": "sdpa"}  # the backend that runs every window and dtype


# --------------------------------------------------------------------------- helpers


def _window_allowed(q_len: int, k_len: int, window: int | None, device: torch.device) -> torch.Tensor:
    """Boolean [q_len, k_len] mask: causal (aligned to the end of the keys) and, if set, a window.

    Same semantics as transformers: key j is visible to query i when j <= i and j > i - window.
    Only ever built per document (or per decode step), never for the whole packed row.
    """
    q_pos = torch.arange(k_len - q_len, k_len, device=device).unsqueeze(1)
    k_pos = torch.arange(k_len, device=device).unsqueeze(0)
    allowed = k_pos <= q_pos
    if window is not None:
        allowed = allowed & (k_pos > q_pos - window)
    return allowed


def _doc_mask(
    batch: PackedBatch | None, length: int, window: int | None, device, k_len: int | None = None
) -> torch.Tensor:
    """A document's causal / window mask, memoised on the batch (one build per shape per batch).
    ``k_len`` > ``length``: a document that also attends to a shared prefix (:mod:`.pairs`)."""
    k_len = length if k_len is None else k_len
    if batch is None:
        return _window_allowed(length, k_len, window, device)
    return batch.memo(
        ("window_mask", length, k_len, window, str(device)),
        lambda: _window_allowed(length, k_len, window, device),
    )


def _check_supported(module: torch.nn.Module, kwargs: dict) -> None:
    softcap = kwargs.get("softcap")
    if softcap is not None:
        raise UnsupportedAttentionFeature(
            f"{type(module).__name__} uses attention logit softcapping (softcap={softcap}); "
            f"slipstream's packed attention does not implement it. Use {UNPACKED}.",
            refused="attention logit softcapping on packed rows",
        )


def _sdpa_one(query, key, value, scaling, dropout, window, batch, short_kernel="off", costs=BUILTIN):
    """SDPA over one document (or one unpacked row): [B, H, L, D] in, [B, H, L, D] out.
    ``short_kernel``: the :mod:`.short_attention` mode (``costs``: its measured reach); a short
    document it takes runs there."""
    if takes_short_kernel(query, key, dropout, short_kernel, costs):
        return short_causal_attention(query, key, value, scaling, window, batch)
    q_len, k_len = query.shape[-2], key.shape[-2]
    enable_gqa = query.shape[1] != key.shape[1]
    if window is None or k_len <= window:
        if q_len == k_len:
            return F.scaled_dot_product_attention(
                query, key, value, is_causal=True, dropout_p=dropout, scale=scaling, enable_gqa=enable_gqa
            )
        if q_len == 1:
            return F.scaled_dot_product_attention(
                query, key, value, dropout_p=dropout, scale=scaling, enable_gqa=enable_gqa
            )
    mask = _doc_mask(batch, q_len, window, query.device, k_len)
    return F.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, dropout_p=dropout, scale=scaling, enable_gqa=enable_gqa
    )


def _sinks_one(module, query, key, value, scaling, dropout, window, sinks, batch):
    """Eager attention with per-head sink logits over one document: [B, H, L, D] in and out.

    The sink is an extra logit per head that takes part in the softmax and is then dropped,
    as in GPT-OSS. Computed in the query's dtype, like the stock eager path.
    """
    q_len, k_len = query.shape[-2], key.shape[-2]
    groups = query.shape[1] // key.shape[1]
    if groups > 1:
        key = key.repeat_interleave(groups, dim=1)
        value = value.repeat_interleave(groups, dim=1)
    scores = torch.matmul(query, key.transpose(-1, -2)) * scaling
    allowed = _doc_mask(batch, q_len, window, query.device, k_len)
    scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
    sink_logits = sinks.reshape(1, -1, 1, 1).expand(query.shape[0], -1, q_len, 1).to(scores.dtype)
    logits = torch.cat([scores, sink_logits], dim=-1)
    logits = logits - logits.max(dim=-1, keepdim=True).values
    probs = torch.softmax(logits, dim=-1)[..., :-1]
    probs = F.dropout(probs, p=dropout, training=module.training).to(value.dtype)
    return torch.matmul(probs, value)


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
    key_prefixes: dict[int, torch.Tensor] = {}
    value_prefixes: dict[int, torch.Tensor] = {}
    if readers:
        # a shared prefix (a pair's prompt, a group's prefix): the first keys of its source document
        # (a slice of that document's split, not of the row), handed to every document that reads it
        # by one node whose backward sums their gradients in fp32 (:class:`_SharedPrefix`)
        keys, key_prefixes = _share_prefixes(keys, readers)
        values, value_prefixes = _share_prefixes(values, readers)
    outputs = []
    for number, (q, k, v) in enumerate(zip(query.split(lengths, 2), keys, values, strict=True)):
        if number in key_prefixes:
            k = torch.cat([key_prefixes[number], k], dim=2)
            v = torch.cat([value_prefixes[number], v], dim=2)
        outputs.append(fn(q, k, v, batch=batch, **kw).transpose(1, 2))
    return torch.cat(outputs, dim=1)


def prefix_readers(batch: PackedBatch) -> dict[int, tuple[tuple[int, int], ...]]:
    """Per source document, the documents that attend to its first tokens as their shared prefix and
    how many each reads: ``{source: ((document, prefix length), ...)}`` ({} without prefixes).
    Host ints, memoised on the batch."""

    def build() -> dict[int, tuple[tuple[int, int], ...]]:
        found: dict[int, list[tuple[int, int]]] = {}
        sources = batch.prefix_sources or range(-1, batch.num_docs - 1)
        for number, span in enumerate(batch.prefix_spans()):
            if span is not None:
                found.setdefault(sources[number], []).append((number, span[1] - span[0]))
        return {source: tuple(docs) for source, docs in found.items()}

    return batch.memo("prefix_readers", build) if batch.has_prefixes else {}


def _share_prefixes(parts, readers):
    """``parts`` (one document's keys or values each, ``[1, Hkv, L, D]``) with every source document
    routed through :class:`_SharedPrefix`; returns them and ``{document: its prefix slice}``."""
    parts = list(parts)
    prefixes: dict[int, torch.Tensor] = {}
    for source, docs in readers.items():
        whole, *slices = _SharedPrefix.apply(parts[source], tuple(n for _, n in docs))
        parts[source] = whole
        prefixes.update(zip((number for number, _ in docs), slices, strict=True))
    return parts, prefixes


class _SharedPrefix(torch.autograd.Function):
    """One document's keys (or values), ``[1, Hkv, L, D]``, handed to its own attention and, sliced,
    to every document that attends to them as a shared prefix: ``(whole, prefix_1, ..., prefix_n)``.

    The prefix's gradient is the sum of its N readers'. Left to autograd, that sum is accumulated
    one reader at a time in the model's dtype, rounding after every addition: in bf16 its error
    grows with N (~sqrt(N) times one rounding: 0.66% at N = 40, 2% at N = 300 against 0.18% summed
    in fp32), in every layer, where the unshared rows sum the same N gradients inside the
    projections' GEMMs (fp32 accumulation, one rounding). Here the readers' gradients are summed
    in fp32 and rounded once. Forward: views, no copy."""

    @staticmethod
    def forward(ctx, whole: torch.Tensor, lengths: tuple[int, ...]):
        ctx.lengths = lengths
        ctx.shape, ctx.dtype = whole.shape, whole.dtype
        ctx.set_materialize_grads(False)
        return (whole.view_as(whole), *(whole[:, :, :n] for n in lengths))

    @staticmethod
    def backward(ctx, grad_whole, *grad_prefixes):
        if all(g is None for g in grad_prefixes):
            return grad_whole, None
        wide = torch.promote_types(ctx.dtype, torch.float32)
        like = next(g for g in grad_prefixes if g is not None)
        if grad_whole is None:
            total = torch.zeros(ctx.shape, dtype=wide, device=like.device)
        else:
            total = grad_whole.to(wide, copy=True)
        for n, grad in zip(ctx.lengths, grad_prefixes, strict=True):
            if grad is not None:
                total[:, :, :n] += grad
        return total.to(ctx.dtype), None


def chunked_attention_size(module) -> int | None:
    """The chunk of a chunked-attention layer (Llama 4: ``layer_types[i] == "chunked_attention"``)."""
    config = getattr(module, "config", None)
    chunk = getattr(config, "attention_chunk_size", None)
    layer_types = getattr(config, "layer_types", None)
    index = getattr(module, "layer_idx", None)
    if not chunk or not layer_types or not isinstance(index, int) or index >= len(layer_types):
        return None
    return int(chunk) if layer_types[index] == "chunked_attention" else None


def _refuse_config_window(module) -> None:
    """A window only the config names (and the model's own mask builder applies) is ambiguous:
    the call does not say whether this layer uses it, so refuse rather than guess."""
    config = getattr(module, "config", None)
    window = getattr(config, "sliding_window", None)
    if isinstance(window, int) and window > 0 and getattr(config, "use_sliding_window", True) is not False:
        raise UnsupportedArchitecture(
            f"{layer_name(module)}: the config has sliding_window={window}, which the model applies through its "
            "own mask builder and does not pass to the attention call, so slipstream cannot tell whether this "
            f"layer uses it. Use {UNPACKED}",
            refused="a sliding window only the config names",
        )


def _config_window_reaches(module, key: torch.Tensor) -> bool:
    """An unpacked row longer than a config-only window: the window would cut it (else it is exact)."""
    window = getattr(getattr(module, "config", None), "sliding_window", None)
    return isinstance(window, int) and window > 0 and key.shape[-2] > window


def _unpack_args(module, query, key, attention_mask, kwargs, scaling, dropout, sliding_window):
    """Check the call; returns (query, batch, scaling, dropout, window, sinks), the query scaled by
    document position where the module's temperature tuning asks for it (:mod:`.rowpos`)."""
    _check_supported(module, kwargs)
    batch = check_attention_call(module, query, key, attention_mask, kwargs)
    if batch is not None:
        query = document_temperature(module, query, batch)
    if sliding_window is _NOT_GIVEN:
        # A window kept on the module and applied by its mask function (not passed to the
        # attention call): the packed backends have no mask function, so they apply it here.
        sliding_window = getattr(module, "sliding_window", None)
        if not isinstance(sliding_window, int) or isinstance(sliding_window, bool) or sliding_window <= 0:
            sliding_window = None
        if sliding_window is None and (batch is not None or _config_window_reaches(module, key)):
            _refuse_config_window(module)
    if batch is not None:
        chunk = chunked_attention_size(module)
        if chunk:
            batch = batch.split_every(chunk)
    if batch is not None and query.shape[0] != 1:
        raise ValueError(
            f"a PackedBatch is one row of documents, but attention got batch size {query.shape[0]}; "
            "pack micro-batches with slipstream.collate_packed"
        )
    scaling = scaling if scaling is not None else 1.0 / math.sqrt(query.shape[-1])
    dropout = dropout if module.training else 0.0
    sinks = kwargs.get("s_aux")
    if sinks is None:
        sinks = getattr(module, "sinks", None)
    return query, batch, scaling, dropout, sliding_window, sinks


def _fallback_unpacked(module, query, key, value, attention_mask, scaling, dropout, window, sinks):
    """No PackedBatch: each row is one causal sequence (unpadded training rows, generation)."""
    if attention_mask is not None:
        # A 4D mask a caller prepared itself: honour it exactly as stock SDPA / eager would.
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        if sinks is not None:
            from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

            return eager_attention_forward(
                module, query, key, value, attention_mask, scaling=scaling, dropout=dropout
            )
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, scaling=scaling, dropout=dropout
        )

    def one(q, k, v):
        if sinks is not None:
            return _sinks_one(module, q, k, v, scaling, dropout, window, sinks, None)
        return _sdpa_one(q, k, v, scaling, dropout, window, None)

    chunk = chunked_attention_size(module)
    length = query.shape[-2]
    if chunk and length == key.shape[-2] and length > chunk:
        # A chunked-attention layer (Llama 4) over a whole row: the model's mask builder, which
        # would cut it into chunks, does not run for slipstream's attention, so cut it here.
        pieces = [chunk] * (length // chunk) + ([length % chunk] if length % chunk else [])
        parts = zip(query.split(pieces, 2), key.split(pieces, 2), value.split(pieces, 2), strict=True)
        out = torch.cat([one(q, k, v) for q, k, v in parts], dim=2)
    else:
        out = one(query, key, value)
    return out.transpose(1, 2).contiguous(), None


# --------------------------------------------------------------------------- backends


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


def _varlen_kernel() -> tuple[str, Callable] | None:
    """The varlen flash kernel available here, if any: torch's own first, then flash-attn."""
    if not torch.cuda.is_available():
        return None
    try:
        from torch.nn.attention.varlen import varlen_attn

        return "torch.varlen_attn", varlen_attn
    except ImportError:
        pass
    try:
        from flash_attn import flash_attn_varlen_func

        return "flash_attn", flash_attn_varlen_func
    except ImportError:
        return None


def packed_varlen_attention(
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
    """One varlen flash-attention call over the whole packed row, reading the batch's cu_seqlens."""
    query, batch, scaling, dropout, window, sinks = _unpack_args(
        module, query, key, attention_mask, kwargs, scaling, dropout, sliding_window
    )
    if batch is None or sinks is not None or query.device.type != "cuda":
        return packed_sdpa_attention(
            module, query, key, value, attention_mask, scaling, dropout, sliding_window, **kwargs
        )
    kernel = _varlen_kernel()
    if kernel is None:
        raise RuntimeError("slipstream_varlen needs CUDA and torch.nn.attention.varlen or flash-attn")
    name, fn = kernel
    if batch.has_prefixes:
        # shared prefixes (pairs, groups): two varlen calls merged by their log-sum-exp where torch's
        # kernel is here and no window cuts a sequence; else per-document SDPA, each with its prefix
        if name != "torch.varlen_attn" or _varlen_ops() is None or window_cuts(batch, window):
            return packed_sdpa_attention(
                module, query, key, value, attention_mask, scaling, dropout, sliding_window, **kwargs
            )
        return prefixed_varlen_attention(query, key, value, batch, scaling), None
    q_THD = query[0].transpose(0, 1)
    k_THD = key[0].transpose(0, 1)
    v_THD = value[0].transpose(0, 1)
    left = -1 if window is None else window - 1
    if name == "torch.varlen_attn":
        params = _varlen_params(fn)
        extra = {}
        if "window_size" in params:
            extra["window_size"] = (left, 0)
        elif window is not None:
            raise UnsupportedAttentionFeature(
                f"this torch's varlen_attn has no sliding window; use backend 'sdpa': {optimize_call(_SDPA)}",
                refused="a sliding window on this torch's varlen_attn",
                avoid=_SDPA,
            )
        else:
            extra["is_causal"] = True
        if "enable_gqa" in params:
            extra["enable_gqa"] = query.shape[1] != key.shape[1]
        elif query.shape[1] != key.shape[1]:
            groups = query.shape[1] // key.shape[1]
            k_THD = k_THD.repeat_interleave(groups, dim=1)
            v_THD = v_THD.repeat_interleave(groups, dim=1)
        out_THD = fn(
            q_THD,
            k_THD,
            v_THD,
            batch.cu_seqlens,
            batch.cu_seqlens,
            batch.max_seqlen,
            batch.max_seqlen,
            scale=scaling,
            **extra,
        )
    else:
        out_THD = fn(
            q_THD,
            k_THD,
            v_THD,
            batch.cu_seqlens,
            batch.cu_seqlens,
            batch.max_seqlen,
            batch.max_seqlen,
            dropout_p=dropout,
            softmax_scale=scaling,
            causal=True,
            window_size=(left, 0),
        )
    return out_THD.unsqueeze(0), None


def window_cuts(batch: PackedBatch, window: int | None) -> bool:
    """A sliding window shorter than some sequence as it runs alone (prefix + own tokens)."""
    return window is not None and window < max(batch.alone_lengths)


def _varlen_ops() -> tuple[Callable, Callable] | None:
    """torch's varlen forward (returning the log-sum-exp) and backward ops, if this torch has them."""
    try:
        import torch.nn.attention.varlen  # noqa: F401 - registers the torch_attn ops
    except ImportError:
        return None
    ops = getattr(torch.ops, "torch_attn", None)
    forward = getattr(ops, "_varlen_attn", None) if ops is not None else None
    backward = getattr(ops, "_varlen_attn_backward", None) if ops is not None else None
    return None if forward is None or backward is None else (forward, backward)


def _op_kwargs(op: Callable, **wanted: Any) -> dict[str, Any]:
    """The keyword arguments of ``wanted`` that ``op``'s schema takes (the varlen ops' signatures grew
    across torch releases); a plain function (a test's stand-in) takes them all. Causality is the
    ``is_causal`` flag, so no window is passed: call 1 is causal, call 2 sees every prefix key."""
    schema = getattr(getattr(op, "default", None), "_schema", None)
    if schema is None:
        return wanted
    names = {argument.name for argument in schema.arguments}
    return {key: value for key, value in wanted.items() if key in names}


class PrefixPlan:
    """What the second varlen call of a row with shared prefixes reads, built once per batch on the
    host: the row positions of every query that has a prefix (its document's tokens, concatenated)
    and of the prefix keys each such document sees (repeated per document), their cu_seqlens and
    maxima. Moved to the batch's device once (pinned, non-blocking)."""

    def __init__(self, batch: PackedBatch):
        query_rows: list[int] = []
        key_rows: list[int] = []
        q_lens: list[int] = []
        k_lens: list[int] = []
        for (start, end), span in zip(batch.doc_bounds(), batch.prefix_spans(), strict=True):
            if span is None:
                continue
            query_rows += range(start, end)
            key_rows += range(*span)
            q_lens.append(end - start)
            k_lens.append(span[1] - span[0])
        device = batch.device

        def move(values: list[int], dtype: torch.dtype) -> torch.Tensor:
            tensor = torch.tensor(values, dtype=dtype)
            if device.type == "cuda" and torch.cuda.is_available():
                return tensor.pin_memory().to(device, non_blocking=True)
            return tensor.to(device)

        self.query_rows = move(query_rows, torch.long)
        self.key_rows = move(key_rows, torch.long)
        self.cu_q = move(cumulative(q_lens), torch.int32)
        self.cu_k = move(cumulative(k_lens), torch.int32)
        self.max_q, self.max_k = max(q_lens), max(k_lens)

    @staticmethod
    def of(batch: PackedBatch) -> PrefixPlan:
        return batch.memo("prefix_plan", lambda: PrefixPlan(batch))


class _PrefixedVarlen(torch.autograd.Function):
    """Varlen attention for a row with shared prefixes, in two kernel calls and no per-document loop.

    Call 1: every document causal over its own tokens (the row's cu_seqlens). Call 2: the queries of
    every document with a prefix, non-causal over its prefix's keys. Their outputs merge by the
    log-sum-exps: ``out = (o1 e^lse1 + o2 e^lse2) / (e^lse1 + e^lse2)``. The kernel's backward drops
    a gradient of its log-sum-exp, so the backward is written here, as ring attention's: each call's
    backward runs with the *merged* output and log-sum-exp, which makes its softmax the merged one;
    the prefix keys' gradients are added back to their rows.
    """

    @staticmethod
    def forward(ctx, q_THD, k_THD, v_THD, batch, scale, enable_gqa):
        forward_op, _ = _varlen_ops()
        plan = PrefixPlan.of(batch)
        n = batch.max_seqlen
        extra = _op_kwargs(forward_op, scale=scale, enable_gqa=enable_gqa)
        out1, lse1_HT, rng1 = forward_op(
            q_THD, k_THD, v_THD, batch.cu_seqlens, batch.cu_seqlens, n, n, True, **extra
        )
        q2 = q_THD.index_select(0, plan.query_rows)
        k2 = k_THD.index_select(0, plan.key_rows)
        v2 = v_THD.index_select(0, plan.key_rows)
        out2, lse2_HQ, rng2 = forward_op(
            q2, k2, v2, plan.cu_q, plan.cu_k, plan.max_q, plan.max_k, False, **extra
        )
        lse1_HQ = lse1_HT.index_select(1, plan.query_rows)
        lse_HQ = torch.logaddexp(lse1_HQ, lse2_HQ)
        w1_QH1 = torch.exp(lse1_HQ - lse_HQ).transpose(0, 1).unsqueeze(-1)
        w2_QH1 = torch.exp(lse2_HQ - lse_HQ).transpose(0, 1).unsqueeze(-1)
        fp = torch.promote_types(out1.dtype, torch.float32)  # the merge in fp32 at least
        merged = out1.index_select(0, plan.query_rows).to(fp) * w1_QH1 + out2.to(fp) * w2_QH1
        out = out1.index_copy(0, plan.query_rows, merged.to(out1.dtype))
        lse_HT = lse1_HT.index_copy(1, plan.query_rows, lse_HQ)
        ctx.save_for_backward(q_THD, k_THD, v_THD, out, lse_HT, rng1, rng2)
        ctx.batch, ctx.scale = batch, scale
        return out

    @staticmethod
    def backward(ctx, grad_THD):
        _, backward_op = _varlen_ops()
        q_THD, k_THD, v_THD, out, lse_HT, rng1, rng2 = ctx.saved_tensors
        batch, scale = ctx.batch, ctx.scale
        plan = PrefixPlan.of(batch)
        grad_THD = grad_THD.contiguous()
        n = batch.max_seqlen
        extra = _op_kwargs(backward_op, scale=scale)
        dq, dk, dv = backward_op(
            grad_THD, q_THD, k_THD, v_THD, out, lse_HT, batch.cu_seqlens, batch.cu_seqlens, n, n, True, rng1,
            **extra,
        )  # fmt: skip
        rows, keys = plan.query_rows, plan.key_rows
        dq2, dk2, dv2 = backward_op(
            grad_THD.index_select(0, rows), q_THD.index_select(0, rows), k_THD.index_select(0, keys),
            v_THD.index_select(0, keys), out.index_select(0, rows), lse_HT.index_select(1, rows).contiguous(),
            plan.cu_q, plan.cu_k, plan.max_q, plan.max_k, False, rng2, **extra,
        )  # fmt: skip
        # a prefix key is read by every document of its group: its rows of dk2 / dv2 (one per reader)
        # are summed in fp32 and rounded once (a bf16 index_add rounds after every addition)
        return _add_rows(dq, rows, dq2), _add_rows(dk, keys, dk2), _add_rows(dv, keys, dv2), None, None, None


def _add_rows(into: torch.Tensor, rows: torch.Tensor, extra: torch.Tensor) -> torch.Tensor:
    """``into`` with ``extra``'s rows added at ``rows`` (repeats summed), in fp32 at least, cast back."""
    wide = torch.promote_types(into.dtype, torch.float32)
    return into.to(wide).index_add_(0, rows, extra.to(wide)).to(into.dtype)


def prefixed_varlen_attention(query, key, value, batch: PackedBatch, scaling: float) -> torch.Tensor:
    """query [1, H, T, D], key / value [1, Hkv, T, D] -> [1, T, H, D]: every document causal over its
    own tokens and, where it has one, over its shared prefix (:class:`_PrefixedVarlen`)."""
    q_THD = query[0].transpose(0, 1)
    k_THD = key[0].transpose(0, 1)
    v_THD = value[0].transpose(0, 1)
    from torch.nn.attention.varlen import varlen_attn

    enable_gqa = query.shape[1] != key.shape[1]
    if enable_gqa and "enable_gqa" not in _varlen_params(varlen_attn):
        groups = query.shape[1] // key.shape[1]
        k_THD = k_THD.repeat_interleave(groups, dim=1)
        v_THD = v_THD.repeat_interleave(groups, dim=1)
        enable_gqa = False
    return _PrefixedVarlen.apply(q_THD, k_THD, v_THD, batch, scaling, enable_gqa).unsqueeze(0)


@functools.cache
def _varlen_params(fn: Callable) -> frozenset[str]:
    """The keyword names this torch's varlen_attn takes (its signature changed across releases)."""
    return frozenset(inspect.signature(fn).parameters)


def flex_block_mask(batch: PackedBatch, window: int | None):
    """Document-causal (and windowed) BlockMask for the packed row, built once per batch."""

    def build():
        from torch.nn.attention.flex_attention import create_block_mask

        # per token, from the host lengths: where its document starts, and the shared prefix it
        # also sees (a range at the start of an earlier document, empty for most documents)
        starts, prefix_starts, prefix_ends = [], [], []
        for (start, end), span in zip(batch.doc_bounds(), batch.prefix_spans(), strict=True):
            length = end - start
            span = span or (start, start)
            starts += [start] * length
            prefix_starts += [span[0]] * length
            prefix_ends += [span[1]] * length
        doc_start = torch.tensor(starts, device=batch.device)
        prefix_start = torch.tensor(prefix_starts, device=batch.device)
        prefix_end = torch.tensor(prefix_ends, device=batch.device)
        # key positions as the document would number them alone (shared prompt first)
        offset = torch.tensor(
            [s - (pe - ps) for s, ps, pe in zip(starts, prefix_starts, prefix_ends, strict=True)],
            device=batch.device,
        )

        def mask_mod(b, h, q_idx, kv_idx):
            own = (kv_idx >= doc_start[q_idx]) & (kv_idx <= q_idx)
            shared = (kv_idx >= prefix_start[q_idx]) & (kv_idx < prefix_end[q_idx])
            allowed = own | shared
            if window is not None:
                # distance as the document alone numbers it: a shared key sits before its own keys
                q_alone = q_idx - offset[q_idx]
                k_alone = torch.where(own, kv_idx - offset[q_idx], kv_idx - prefix_start[q_idx])
                allowed = allowed & (k_alone > q_alone - window)
            return allowed

        T = batch.num_tokens
        return create_block_mask(mask_mod, B=None, H=None, Q_LEN=T, KV_LEN=T, device=batch.device)

    return batch.memo(("flex_block_mask", window), build)


def packed_flex_attention(
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
    """flex_attention with a BlockMask memoised on the batch (built once, used by every layer)."""
    query, batch, scaling, dropout, window, sinks = _unpack_args(
        module, query, key, attention_mask, kwargs, scaling, dropout, sliding_window
    )
    if batch is None or sinks is not None:
        return packed_sdpa_attention(
            module, query, key, value, attention_mask, scaling, dropout, sliding_window, **kwargs
        )
    from torch.nn.attention.flex_attention import flex_attention

    out = flex_attention(
        query,
        key,
        value,
        block_mask=flex_block_mask(batch, window),
        scale=scaling,
        enable_gqa=query.shape[1] != key.shape[1],
    )
    return out.transpose(1, 2).contiguous(), None


# transformers runs its own SDPA / flex capability checks on any name containing "sdpa" or
# "flex_attention" (and refuses GPT-OSS for them), so the registered names avoid both.
ATTENTION_FUNCTIONS: dict[str, Callable] = {
    "slipstream_docwise": packed_sdpa_attention,
    "slipstream_varlen": packed_varlen_attention,
    "slipstream_flex": packed_flex_attention,
}


BACKEND_NAMES = {"sdpa": "slipstream_docwise", "varlen": "slipstream_varlen", "flex": "slipstream_flex"}


def register_attention_functions(outside_graphs: bool = False) -> None:
    """Register the packed backends with transformers (idempotent).

    No mask function is registered on purpose: for an attention name without one,
    transformers' mask builders return ``None`` straight away, before they would inspect
    position_ids (a host sync) or build a dense [B, 1, T, T] mask.

    ``outside_graphs``: register them wrapped in ``torch.compiler.disable``, for compiled decoder
    layers (``slipstream.compile``): the per-document loop over the batch's host lengths then runs
    eagerly between two graphs, so no graph specializes on a batch's document count. Once
    registered so they stay so (the wrapper is the same function to an eager caller).
    """
    from transformers import AttentionInterface

    global _OUTSIDE_GRAPHS
    _OUTSIDE_GRAPHS = _OUTSIDE_GRAPHS or outside_graphs
    for name, fn in ATTENTION_FUNCTIONS.items():
        AttentionInterface.register(name, _disabled(fn) if _OUTSIDE_GRAPHS else fn)


_OUTSIDE_GRAPHS = False


@functools.cache
def _disabled(fn: Callable) -> Callable:
    """``fn`` run eagerly between two compiled graphs (``slipstream.compile``). Its output crosses
    into the next graph, which dynamo guards on, and it guards a view on its base's sizes: an output
    that is a view for one batch (one document: SDPA's output transposed back; varlen's ``unsqueeze``)
    and a fresh tensor for the next (several documents, grouped) rebuilt that graph mid-run. So a view
    is handed over as a fresh copy (one [T, H, D] copy, only where compiled layers run): every batch,
    whatever its path, gives the graph the same kind of tensor."""

    @torch.compiler.disable
    @functools.wraps(fn)
    def outside_graphs(*args, **kwargs):
        out, weights = fn(*args, **kwargs)
        if out._is_view():
            out = out.clone(memory_format=torch.contiguous_format)
        return out, weights

    return outside_graphs


VARLEN_DTYPES = (torch.float16, torch.bfloat16)  # the varlen kernels are flash attention's


def choose_backend(
    requested: str, device: torch.device, has_sinks: bool, dtype: torch.dtype | None = None
) -> tuple[str, str]:
    """Pick a backend for ``requested`` ("auto" or one of BACKENDS); returns (backend, reason).

    ``dtype``: the attention inputs' dtype (the model's). The varlen kernels run fp16 / bf16 only,
    so "auto" keeps an fp32 model on per-document SDPA and an explicit "varlen" is refused.
    """
    if requested not in ("auto", *BACKENDS):
        raise ValueError(f"attention_backend must be 'auto' or one of {BACKENDS}, got {requested!r}")
    if requested != "auto":
        if requested == "varlen" and _varlen_kernel() is None:
            raise AttentionBackendUnavailable(
                "attention_backend='varlen' needs CUDA and torch.nn.attention.varlen or flash-attn",
                refused="attention_backend='varlen' without its kernel",
            )
        if requested == "varlen" and dtype is not None and dtype not in VARLEN_DTYPES:
            raise AttentionBackendUnavailable(
                f"attention_backend='varlen' runs float16 / bfloat16 only (flash attention), not "
                f"{str(dtype).removeprefix('torch.')}: use 'sdpa' or 'auto'",
                refused=f"attention_backend='varlen' for a {str(dtype).removeprefix('torch.')} model",
            )
        return requested, "requested"
    if device.type == "cuda":
        kernel = _varlen_kernel()
        if kernel is not None and not has_sinks and dtype is not None and dtype not in VARLEN_DTYPES:
            return "sdpa", (
                f"{str(dtype).removeprefix('torch.')} model: per-document SDPA (the varlen kernels "
                "run float16 / bfloat16 only)"
            )
        if kernel is not None and not has_sinks:
            return "varlen", f"CUDA with {kernel[0]}"
        if has_sinks:
            return "sdpa", "attention sinks: per-document path (no fused varlen kernel has sinks)"
        return "sdpa", "CUDA without a varlen kernel"
    return "sdpa", f"{device.type}: per-document SDPA"
