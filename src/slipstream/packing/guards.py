"""Guards that make silent cross-document attention impossible.

A packed row holds several documents; stock attention over it lets them see each other. So
while a model runs forward on a :class:`PackedBatch`, that batch is *active* (a context
variable set by a forward pre-hook on the model and reset by a forward hook that always
runs, even on error), and:

- every call to a packed attention function must receive the batch: a decoder layer that
  does not pass its attention kwargs on (so the attention would run plain causal attention
  over the whole row) makes the step raise, naming the layer;
- the packed attention refuses what it cannot honour instead of dropping it: a mask the
  model built itself (a learned bias, chunked or bidirectional regions), keyword arguments
  it does not know that carry tensors or numbers (flags such as ``output_router_logits``
  pass), keys of another length than the queries (compressed / pooled KV), a non-causal call.

All checks read Python objects (the kwargs, shapes, the context variable): no device value
is read, so a packed step still has no host sync.
"""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar

import torch

from ..refusal import Refusal, optimize_call
from .batch import PACKED_BATCH_KWARG, PackedBatch


class UnsupportedArchitecture(Refusal, NotImplementedError):
    """A model (or one of its layers) cannot be trained packed exactly; the message says what to do."""

    avoid = {"packed_attention": False}


# The way out the messages name, generated from the class's ``avoid`` (text and data cannot drift).
UNPACKED = optimize_call(UnsupportedArchitecture.avoid)  # slipstream.optimize(model, packed_attention=False)
TRAIN_UNPACKED = f"Train this model unpacked: {UNPACKED}"


# The batches of the forwards running now, innermost last (a model may call another's forward).
_RUNNING: ContextVar[tuple[PackedBatch | None, ...]] = ContextVar("slipstream_packed_forwards", default=())

# Keyword arguments transformers' attention modules hand to an attention function that the
# packed backends either use or can ignore without changing the result.
KNOWN_ATTENTION_KWARGS = frozenset(
    {
        PACKED_BATCH_KWARG,
        "position_ids",  # rotary embeddings were applied before the call; boundaries come from the batch
        "cu_seq_lens_q",
        "cu_seq_lens_k",
        "max_length_q",
        "max_length_k",
        "s_aux",  # attention sinks (GPT-OSS): honoured
        "softcap",  # refused by the backends when set
        "is_causal",  # checked: must not be False
        "output_attentions",
        "use_cache",
        "cache_position",
        "past_key_values",
        "cache",
        "layer_idx",
        "head_mask",
        "num_items_in_batch",  # the loss's, passed along by some models
        "return_dict",
        "logits_to_keep",
    }
)


# Called with the module of every packed-attention call while a model's first packed forward is
# being verified (see verdict.AttentionRouteCheck); empty otherwise.
ATTENTION_CALL_LISTENERS: list = []


def active_batch() -> PackedBatch | None:
    """The PackedBatch the running forward was given, if any."""
    running = _RUNNING.get()
    return running[-1] if running else None


def enter_forward(module: torch.nn.Module, args, kwargs):
    """Forward pre-hook: the batch (or None) becomes the active one for this forward."""
    _RUNNING.set((*_RUNNING.get(), kwargs.get(PACKED_BATCH_KWARG)))
    return None


def leave_forward(module: torch.nn.Module, args, kwargs, output):
    """Forward hook (registered with ``always_call``): this forward's batch is no longer active."""
    _RUNNING.set(_RUNNING.get()[:-1])
    return None


@contextmanager
def running_unpacked():
    """Inside, the running forward has no packed batch: a module run on one document alone
    (the per-document adaptation) attends causally over just that document."""
    token = _RUNNING.set((*_RUNNING.get(), None))
    try:
        yield
    finally:
        _RUNNING.reset(token)


def bind_running(function):
    """``function`` to be called later (a checkpointed layer's recompute in backward) with the
    forwards that are running now still active, so guards and adaptations see the same batch."""
    running = _RUNNING.get()

    def run(*args, **kwargs):
        token = _RUNNING.set(running)
        try:
            return function(*args, **kwargs)
        finally:
            _RUNNING.reset(token)

    return run


def _is_input(value) -> bool:
    """A value an attention would compute with (tensors, numbers), not a flag (bools, names, None)."""
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return False
    if isinstance(value, list | tuple):
        return any(_is_input(v) for v in value)
    return isinstance(value, torch.Tensor | int | float)


def layer_name(module: torch.nn.Module) -> str:
    index = getattr(module, "layer_idx", None)
    return f"{type(module).__name__}" + (f" (layer {index})" if index is not None else "")


def check_attention_call(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    attention_mask: torch.Tensor | None,
    kwargs: dict,
) -> PackedBatch | None:
    """The batch this attention call must use; raise if the call would mix documents silently."""
    batch = kwargs.get(PACKED_BATCH_KWARG)
    for listener in ATTENTION_CALL_LISTENERS:
        listener(module)
    active = active_batch()
    if batch is None:
        if active is not None:
            raise UnsupportedArchitecture(
                f"{layer_name(module)} was called without the packed batch while the model runs on one: "
                "its decoder layer does not pass its attention kwargs on, so it would attend across "
                f"documents. {TRAIN_UNPACKED}",
                refused="a decoder layer that does not pass the packed batch to its attention",
            )
        return None
    if attention_mask is not None:
        raise UnsupportedArchitecture(
            f"{layer_name(module)} builds an attention mask of its own ({tuple(attention_mask.shape)}) that "
            f"slipstream's packed attention cannot honour. Use {UNPACKED}",
            refused="an attention mask of the layer's own on packed rows",
        )
    unknown = sorted(k for k, v in kwargs.items() if k not in KNOWN_ATTENTION_KWARGS and _is_input(v))
    if unknown:
        raise UnsupportedArchitecture(
            f"{layer_name(module)} passes attention inputs slipstream's packed attention does not implement "
            f"({', '.join(unknown)}). Use {UNPACKED}",
            refused=f"attention inputs the packed attention does not implement ({', '.join(unknown)})",
        )
    is_causal = kwargs.get("is_causal")
    if is_causal is None:  # transformers' own rule: the call's flag, else the module's
        is_causal = getattr(module, "is_causal", True)
    if is_causal is False:
        raise UnsupportedArchitecture(
            f"{layer_name(module)} asks for non-causal attention; packed training is causal only. "
            f"Use {UNPACKED}",
            refused="non-causal attention on packed rows",
        )
    if key.shape[-2] != query.shape[-2]:
        raise UnsupportedArchitecture(
            f"{layer_name(module)} attends with {key.shape[-2]} keys for {query.shape[-2]} queries "
            "(compressed or pooled keys), which the per-document packed attention cannot split. "
            f"Use {UNPACKED}",
            refused="compressed or pooled keys on packed rows",
        )
    return batch
