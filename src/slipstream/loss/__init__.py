"""The LM head and its cross-entropy a chunk of labelled tokens at a time: no [tokens, vocab] logits.

``ChunkedLoss.install(model)`` plugs it into a transformers causal LM (``slipstream.optimize``
does this by default); ``linear_cross_entropy`` is the computation itself, usable on its own.
"""

from .chunked_loss import (
    ChunkedLoss,
    LogitsNotComputed,
    LogitsNotComputedError,
    UnsupportedLoss,
    check_supported,
    transform_candidates,
)
from .linear_ce import LinearHead, LogitTransform, choose_chunk_tokens, linear_cross_entropy

__all__ = [
    "ChunkedLoss",
    "LinearHead",
    "LogitTransform",
    "LogitsNotComputed",
    "LogitsNotComputedError",
    "UnsupportedLoss",
    "check_supported",
    "choose_chunk_tokens",
    "linear_cross_entropy",
    "transform_candidates",
]
