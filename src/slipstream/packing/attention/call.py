"""What every packed backend does before it attends: check the call, read the ``PackedBatch`` and
the window, sinks, scaling and dropout it runs with; and the unpacked path (no ``PackedBatch``:
each row one causal sequence) every backend falls back to."""

from __future__ import annotations

import math
from typing import Any

import torch

from ...refusal import Refusal
from ..guards import UNPACKED, UnsupportedArchitecture, check_attention_call, layer_name
from ..rowpos import document_temperature
from .documents import _sdpa_one, _sinks_one

_NOT_GIVEN: Any = object()  # an attention call that did not pass sliding_window at all (None: no window)


class UnsupportedAttentionFeature(Refusal, NotImplementedError):
    """A model asks for an attention feature the packed backends do not implement."""

    avoid = {"packed_attention": False}


_SDPA = {"attention_backend": "sdpa"}  # the backend that runs every window and dtype


def _check_supported(module: torch.nn.Module, kwargs: dict) -> None:
    softcap = kwargs.get("softcap")
    if softcap is not None:
        raise UnsupportedAttentionFeature(
            f"{type(module).__name__} uses attention logit softcapping (softcap={softcap}); "
            f"slipstream's packed attention does not implement it. Use {UNPACKED}.",
            refused="attention logit softcapping on packed rows",
        )


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
        parts = zip(query.split(chunk, 2), key.split(chunk, 2), value.split(chunk, 2), strict=True)
        out = torch.cat([one(q, k, v) for q, k, v in parts], dim=2)
    else:
        out = one(query, key, value)
    return out.transpose(1, 2).contiguous(), None
