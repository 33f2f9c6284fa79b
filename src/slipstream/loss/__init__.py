"""The LM head and its cross-entropy a chunk of labelled tokens at a time: no [tokens, vocab] logits.

``ChunkedLoss.install(model)`` plugs it into a transformers causal LM (``slipstream.optimize``
does this by default); ``chunked_evaluation(model)`` makes evaluation forwards with labels use
it too (the loss only, no logits); ``linear_cross_entropy`` is the computation itself, usable on its own.
"""

from .answer_logprobs import answer_logprobs, answer_logprobs_from_logits
from .chunked_loss import (
    ChunkedLoss,
    LogitsNotComputed,
    LogitsNotComputedError,
    UnsupportedLoss,
    answer_logprobs_of,
    check_supported,
    chunked_evaluation,
    packed_loss_from_logits,
    transform_candidates,
)
from .linear_ce import LinearHead, LogitTransform, choose_chunk_tokens, linear_cross_entropy

__all__ = [
    "ChunkedLoss",
    "answer_logprobs",
    "answer_logprobs_from_logits",
    "answer_logprobs_of",
    "LinearHead",
    "LogitTransform",
    "LogitsNotComputed",
    "LogitsNotComputedError",
    "UnsupportedLoss",
    "check_supported",
    "chunked_evaluation",
    "choose_chunk_tokens",
    "linear_cross_entropy",
    "packed_loss_from_logits",
    "transform_candidates",
]
