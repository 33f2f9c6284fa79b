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

Modules, one job each: ``dispatch`` (the backends' names, their registration, ``choose_backend``);
``call`` (every backend's checks of the call, and the unpacked path); ``documents`` (attention over
one document); ``sdpa``, ``varlen`` (+ ``prefixed_varlen``: rows with shared prefixes) and ``flex``
(the three backends); ``shared_prefix`` (a prefix handed to its readers on the per-document paths).
The short-document kernel is :mod:`..short_attention`. A test that swaps a function out patches it
in the module that calls it (``attention.sdpa.run_grouped``, ``attention.varlen.varlen_kernel``).
"""

from .call import UnsupportedAttentionFeature, chunked_attention_size
from .dispatch import (
    ATTENTION_FUNCTIONS,
    BACKEND_NAMES,
    BACKENDS,
    VARLEN_DTYPES,
    AttentionBackend,
    AttentionBackendUnavailable,
    _disabled,
    choose_backend,
    register_attention_functions,
)
from .documents import _sdpa_one, _window_allowed
from .flex import flex_block_mask, packed_flex_attention
from .prefixed_varlen import PrefixPlan, prefixed_varlen_attention
from .sdpa import _per_document, packed_sdpa_attention
from .shared_prefix import prefix_readers
from .varlen import packed_varlen_attention, varlen_kernel, window_cuts

__all__ = [
    "ATTENTION_FUNCTIONS",
    "BACKENDS",
    "BACKEND_NAMES",
    "VARLEN_DTYPES",
    "AttentionBackend",
    "AttentionBackendUnavailable",
    "PrefixPlan",
    "UnsupportedAttentionFeature",
    "_disabled",
    "_per_document",
    "_sdpa_one",
    "_window_allowed",
    "choose_backend",
    "chunked_attention_size",
    "flex_block_mask",
    "packed_flex_attention",
    "packed_sdpa_attention",
    "packed_varlen_attention",
    "prefix_readers",
    "prefixed_varlen_attention",
    "register_attention_functions",
    "varlen_kernel",
    "window_cuts",
]
