"""Before packed training starts: can this model be trained packed exactly, and how?

``slipstream.optimize`` calls :func:`architecture_verdict` before it switches a model onto the
packed attention. The verdict reads the model's structure and config only (no forward):

* **refused** (:class:`UnsupportedArchitecture`, naming the feature and the way out) when
  the attention does not go through transformers' ``AttentionInterface``, the model is an
  encoder-decoder, uses attention-logit soft-capping, or selects keys with a sparse-attention
  indexer that reads the model's own mask;
* **adapted**, each adaptation logged, where an exact one is simple:

  - *token mixers other than attention* (causal convolutions, Mamba / SSM scans, linear or
    lightning attention, recurrent blocks) would carry state from one document into the next.
    Each such mixer runs once per document instead (its inputs sliced at the document
    bounds, which the batch holds as Python ints: no host sync), so its taps and state start
    from zero at every document start, exactly as when the document runs alone;
  - *RoBERTa-style learned positions* start at ``padding_idx + 1``: the packed position ids
    (0 at every document start) are shifted by that offset before the embeddings read them;

* **on** otherwise. What the verdict cannot see statically is guarded at run time
  (:mod:`.guards`): an attention call that loses the batch, a mask of the model's own,
  unknown attention inputs, non-causal calls, keys of another length than the queries.

The compatibility sweep (``benchmarks/compat_sweep.py``) checks the verdict against the stock
model on every causal LM transformers registers.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .batch import PACKED_BATCH_KWARG, PackedBatch
from .guards import UnsupportedArchitecture, active_batch, running_unpacked

TRAIN_UNPACKED = "Train this model unpacked: slipstream.optimize(model, packed_attention=False)"

# Class names of modules that mix tokens without transformers' attention (matched on the
# direct children of each decoder layer, besides any child holding a Conv1d).
_MIXER_NAME = re.compile(
    r"mamba|ssm|mixer|shortconv|conv|deltanet|linearattention|lightningattention|rwkv|recurrent|rglru|"
    r"retention|hyena|lstm|gla(?![a-z])|timemix|tokenshift",
    re.IGNORECASE,
)
_NOT_A_MIXER = re.compile(r"norm|mlp|moe|expert|embedding|rotary|router|gate$", re.IGNORECASE)


@dataclass
class ArchitectureVerdict:
    """What optimize will do for a model's packed training."""

    model_name: str
    mixers: list[tuple[str, torch.nn.Module]] = field(default_factory=list)  # (qualified name, module)
    position_offset: int = 0  # added to packed position ids (RoBERTa-style embeddings)

    def adaptations(self) -> list[str]:
        notes = []
        if self.mixers:
            kinds = sorted({type(m).__name__ for _, m in self.mixers})
            notes.append(
                f"adapted: {len(self.mixers)} token mixer(s) ({', '.join(kinds)}) run once per document, "
                "so their conv taps / recurrent state restart at every document start"
            )
        if self.position_offset:
            notes.append(
                f"adapted: packed position ids shifted by {self.position_offset} (learned positions start at "
                "padding_idx + 1, as the embeddings count them for a document alone)"
            )
        return notes


def _decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]


def _is_attention(module: torch.nn.Module) -> bool:
    """A module that runs transformers' attention (holds q/k/v projections and no recurrence)."""
    name = type(module).__name__
    return "Attention" in name and not _MIXER_NAME.search(name)


def find_token_mixers(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """Modules of the decoder layers that mix tokens by something other than attention."""
    layers = _decoder_layers(model)
    names = {id(m): n for n, m in model.named_modules()}
    found: list[tuple[str, torch.nn.Module]] = []
    for layer in layers:
        for child in layer.children():
            if child is None:
                continue
            cls = type(child).__name__
            # A convolution over the tokens mixes them whatever the module is called (an
            # attention whose q/k go through a causal conv, as in Zaya's CCA, included).
            has_conv = any(isinstance(m, torch.nn.Conv1d) for m in child.modules())
            if has_conv or (
                not _is_attention(child) and _MIXER_NAME.search(cls) and not _NOT_A_MIXER.search(cls)
            ):
                found.append((names.get(id(child), cls), child))
    return found


def _sparse_indexers(model: torch.nn.Module) -> list[str]:
    return sorted({type(m).__name__ for m in model.modules() if type(m).__name__.endswith("Indexer")})


def _position_offset(model: torch.nn.Module) -> int:
    """``padding_idx + 1`` for embeddings that count positions from there (RoBERTa and kin)."""
    for module in model.modules():
        if hasattr(module, "create_position_ids_from_input_ids") and hasattr(module, "position_embeddings"):
            padding_idx = getattr(module, "padding_idx", None)
            if isinstance(padding_idx, int):
                return padding_idx + 1
    return 0


def architecture_verdict(model: torch.nn.Module) -> ArchitectureVerdict:
    """Refuse (raise) or describe the adaptations packed training of ``model`` needs."""
    config = model.config
    name = type(model).__name__
    if not getattr(model, "_supports_attention_backend", False):
        raise UnsupportedArchitecture(
            f"{name} does not route attention through transformers' AttentionInterface, so slipstream "
            f"cannot plug packed attention into it. {TRAIN_UNPACKED}"
        )
    if getattr(config, "is_encoder_decoder", False) or not getattr(config, "is_causal", True):
        raise UnsupportedArchitecture(
            f"{name}: packed attention is for causal decoder-only models. {TRAIN_UNPACKED}"
        )
    for key in ("attn_logit_softcapping", "attention_logit_softcapping"):
        softcap = getattr(config, key, None) or getattr(config.get_text_config(), key, None)
        if softcap:
            raise UnsupportedArchitecture(
                f"{name} uses attention logit softcapping ({key}={softcap}); slipstream's packed attention does "
                f"not implement it and will not compute something else. {TRAIN_UNPACKED}"
            )
    chunk = getattr(config, "attention_chunk_size", None) or getattr(
        config.get_text_config(), "attention_chunk_size", None
    )
    if chunk:
        raise UnsupportedArchitecture(
            f"{name} uses chunked attention (attention_chunk_size={chunk}), applied by its own mask builder; "
            f"slipstream's packed attention does not implement it. {TRAIN_UNPACKED}"
        )
    indexers = _sparse_indexers(model)
    if indexers:
        raise UnsupportedArchitecture(
            f"{name} selects attention keys with a sparse-attention indexer ({', '.join(indexers)}) that reads the "
            f"model's own mask over the whole row; slipstream does not split it per document. {TRAIN_UNPACKED}"
        )
    return ArchitectureVerdict(name, mixers=find_token_mixers(model), position_offset=_position_offset(model))


# --------------------------------------------------------------------------- adaptations


def _slice_tokens(value, start: int, end: int, length: int):
    """``value`` cut to tokens [start, end) where it is laid out per token (dim 1 of size T)."""
    if isinstance(value, torch.Tensor):
        if value.dim() >= 2 and value.shape[0] == 1 and value.shape[1] == length:
            return value[:, start:end]
        return value
    if isinstance(value, tuple | list):
        return type(value)(_slice_tokens(v, start, end, length) for v in value)
    return value


def _per_document_forward(module: torch.nn.Module, forward: Callable) -> Callable:
    def run(*args, **kwargs):
        batch: PackedBatch | None = kwargs.get(PACKED_BATCH_KWARG) or active_batch()
        if batch is None or len(batch.seq_lens) == 1:
            return forward(*args, **kwargs)
        hidden = args[0] if args else kwargs.get("hidden_states")
        if not isinstance(hidden, torch.Tensor) or hidden.dim() != 3 or hidden.shape[0] != 1:
            raise UnsupportedArchitecture(
                f"{type(module).__name__} got hidden states of shape "
                f"{getattr(hidden, 'shape', None)}; the per-document adaptation needs one packed row [1, T, D]. "
                + TRAIN_UNPACKED
            )
        length = hidden.shape[1]
        mask = kwargs.get("attention_mask")
        if isinstance(mask, torch.Tensor) and mask.dim() > 2:
            raise UnsupportedArchitecture(
                f"{type(module).__name__} was given a {mask.dim()}-D attention mask it would apply across the row. "
                + TRAIN_UNPACKED
            )
        pieces = []
        for start, end in batch.doc_bounds():
            doc_args = [_slice_tokens(a, start, end, length) for a in args]
            doc_kwargs = {
                k: _slice_tokens(v, start, end, length) for k, v in kwargs.items() if k != PACKED_BATCH_KWARG
            }
            with running_unpacked():  # an attention inside sees one document, causally
                pieces.append(forward(*doc_args, **doc_kwargs))
        first = pieces[0]
        if isinstance(first, torch.Tensor):
            return torch.cat(pieces, dim=1)
        if isinstance(first, tuple) and isinstance(first[0], torch.Tensor):
            # Extra outputs (a recurrent state, attention weights) belong to one document each and
            # cannot be joined into the row's: they come back as None, so a caller that reads them
            # fails loudly instead of using one document's state for the whole row.
            return (torch.cat([piece[0] for piece in pieces], dim=1), *([None] * (len(first) - 1)))
        raise UnsupportedArchitecture(
            f"{type(module).__name__} returns {type(first).__name__}. {TRAIN_UNPACKED}"
        )

    return run


def apply_adaptations(model: torch.nn.Module, verdict: ArchitectureVerdict) -> Callable[[], None]:
    """Install the verdict's adaptations on ``model``; returns the function that removes them."""
    undo: list[Callable[[], None]] = []
    for _, module in verdict.mixers:
        if "forward" in vars(module):  # already adapted
            continue
        module.forward = _per_document_forward(module, module.forward)
        undo.append(lambda module=module: vars(module).pop("forward", None))
    if verdict.position_offset:
        offset = verdict.position_offset

        def shift_positions(_module, args, kwargs):
            position_ids = kwargs.get("position_ids")
            if kwargs.get(PACKED_BATCH_KWARG) is not None and isinstance(position_ids, torch.Tensor):
                kwargs["position_ids"] = position_ids + offset
                return args, kwargs
            return None

        handle = model.register_forward_pre_hook(shift_positions, with_kwargs=True)
        undo.append(handle.remove)

    def remove() -> None:
        for step in reversed(undo):
            step()

    return remove


__all__ = [
    "TRAIN_UNPACKED",
    "ArchitectureVerdict",
    "apply_adaptations",
    "architecture_verdict",
    "find_token_mixers",
]
