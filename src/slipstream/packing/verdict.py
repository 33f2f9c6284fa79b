"""Before packed training starts: can this model be trained packed exactly, and how?

``slipstream.optimize`` calls :func:`architecture_verdict` before it switches a model onto the
packed attention. The verdict reads the model's structure and config only (no forward):

* **refused** (:class:`UnsupportedArchitecture`, naming the feature and the way out) when
  the attention does not go through transformers' ``AttentionInterface`` (a hybrid whose
  ``_supports_attention_backend`` is False because of its Mamba / linear-attention layers is
  accepted, and its packed forwards check that every attention module that runs calls
  slipstream's attention: :class:`AttentionRouteCheck`), its forward takes no
  ``position_ids`` (positions could not restart per document), the model is an
  encoder-decoder, uses attention-logit soft-capping, selects keys with a sparse-attention
  indexer that reads the model's own mask, or chunks attention without saying which layers;
* **adapted**, each adaptation logged, where an exact one is simple:

  - *token mixers other than attention* (causal convolutions, Mamba / SSM scans, linear or
    lightning attention, recurrent blocks) would carry state from one document into the next.
    Each such mixer runs once per document instead (its inputs sliced at the document
    bounds, which the batch holds as Python ints: no host sync), so its taps and state start
    from zero at every document start, exactly as when the document runs alone;
  - *chunked attention* (Llama 4): the layers ``layer_types`` names ``chunked_attention`` see
    each document as pieces of ``attention_chunk_size`` tokens counted from its start, as the
    document alone would, by attending each piece as a document;
  - *RoBERTa-style learned positions* start at ``padding_idx + 1``: the packed position ids
    (0 at every document start) are shifted by that offset before the embeddings read them;
  - *values read off the row* rather than position_ids (Llama 4's attention temperature
    tuning, longrope's choice of factors, dynamic RoPE's growth): :mod:`.rowpos`, which also
    records what an audit of the registry found;

* **on** otherwise. What the verdict cannot see statically is guarded at run time
  (:mod:`.guards`): an attention call that loses the batch, a mask of the model's own,
  unknown attention inputs, non-causal calls, keys of another length than the queries.

The compatibility sweep (``benchmarks/compat_sweep.py``) checks the verdict against the stock
model on every causal LM transformers registers.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from transformers.modeling_layers import GradientCheckpointingLayer

from .batch import PACKED_BATCH_KWARG, PackedBatch
from .guards import (
    ATTENTION_CALL_LISTENERS,
    TRAIN_UNPACKED,
    UnsupportedArchitecture,
    active_batch,
    running_unpacked,
)
from .rowpos import RowPositionFeature, row_position_features

# Class names of modules that mix tokens without transformers' attention (matched on the
# direct children of each decoder layer, besides any child holding a Conv1d).
_MIXER_NAME = re.compile(
    r"mamba|ssm|mixer|shortconv|conv|deltanet|linearattention|lightningattention|rwkv|recurrent|rglru|"
    r"retention|hyena|lstm|gla(?![a-z])|timemix|tokenshift",
    re.IGNORECASE,
)
# A bias over token pairs the model computes for the whole row (relative positions).
_POSITION_BIAS = re.compile(r"relativeposition|positionbias", re.IGNORECASE)
_NOT_A_MIXER = re.compile(r"norm|mlp|moe|expert|embedding|rotary|router|gate$", re.IGNORECASE)


@dataclass
class ArchitectureVerdict:
    """What optimize will do for a model's packed training."""

    model_name: str
    mixers: list[tuple[str, torch.nn.Module]] = field(default_factory=list)  # (qualified name, module)
    position_offset: int = 0  # added to packed position ids (RoBERTa-style embeddings)
    attention_chunk: int | None = None  # chunked-attention layers attend within pieces of this size
    # checked on the first packed forward
    attention_to_verify: list[torch.nn.Module] = field(default_factory=list)
    row_features: list[RowPositionFeature] = field(default_factory=list)  # values read off the row (.rowpos)

    def adaptations(self) -> list[str]:
        notes = []
        if self.mixers:
            kinds = sorted({type(m).__name__ for _, m in self.mixers})
            notes.append(
                f"adapted: {len(self.mixers)} token mixer(s) ({', '.join(kinds)}) run once per document, "
                "so their conv taps / recurrent state restart at every document start"
            )
        if self.attention_to_verify:
            notes.append(
                f"adapted: transformers does not say this model's attention uses its AttentionInterface; "
                f"the first packed forward checks that all {len(self.attention_to_verify)} attention modules do"
            )
        if self.attention_chunk:
            notes.append(
                f"adapted: chunked-attention layers attend within pieces of {self.attention_chunk} tokens counted "
                "from each document's start (each piece attended as a document)"
            )
        if self.position_offset:
            notes.append(
                f"adapted: packed position ids shifted by {self.position_offset} (learned positions start at "
                "padding_idx + 1, as the embeddings count them for a document alone)"
            )
        notes += [feature.note for feature in self.row_features]
        return notes


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's decoder layers (transformers' GradientCheckpointingLayer), in forward order."""
    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]


def _is_attention(module: torch.nn.Module) -> bool:
    """A module that runs transformers' attention (holds q/k/v projections and no recurrence)."""
    name = type(module).__name__
    return "Attention" in name and not _MIXER_NAME.search(name)


def find_token_mixers(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """Modules of the decoder layers that mix tokens by something other than attention."""
    layers = decoder_layers(model)
    names = {id(m): n for n, m in model.named_modules()}
    found: list[tuple[str, torch.nn.Module]] = []
    for layer in layers:
        for child in layer.children():  # (children() skips None entries)
            cls = type(child).__name__
            # A convolution over the tokens mixes them whatever the module is called (an
            # attention whose q/k go through a causal conv, as in Zaya's CCA, included).
            has_conv = any(isinstance(m, torch.nn.Conv1d) for m in child.modules())
            if has_conv or (
                not _is_attention(child) and _MIXER_NAME.search(cls) and not _NOT_A_MIXER.search(cls)
            ):
                found.append((names.get(id(child), cls), child))
    return found


def _attention_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The decoder layers' attention modules (not the token mixers named like attention)."""
    mixers = {id(m) for _, m in find_token_mixers(model)}
    return [
        child
        for layer in decoder_layers(model)
        for child in layer.children()
        if _is_attention(child) and id(child) not in mixers
    ]


class AttentionRouteCheck:
    """On the first packed forward, every attention module that runs must call slipstream's
    attention; one that computes attention itself would attend across documents unseen.

    Hooks on the attention modules note which ran (with a packed batch active); a listener in
    the guards notes which called the packed attention; a hook on the model compares the two
    when its forward ends: it raises naming the modules that did not (and stays armed, so
    every later packed forward raises too); it removes itself once every attention module has
    been seen routed (a layer that skips the first forward is checked when it first runs).
    """

    def __init__(self, model: torch.nn.Module, modules: list[torch.nn.Module]):
        self.expected = {id(m) for m in modules}
        self.verified: set[int] = set()
        self.ran: dict[int, torch.nn.Module] = {}
        self.called: set[int] = set()
        self.handles = [m.register_forward_pre_hook(self._ran) for m in modules]
        self.handles.append(model.register_forward_hook(self._check))
        ATTENTION_CALL_LISTENERS.append(self._called)

    def _ran(self, module, args) -> None:
        if active_batch() is not None:
            self.ran[id(module)] = module

    def _called(self, module) -> None:
        self.called.add(id(module))

    def _check(self, model, args, output) -> None:
        if not self.ran:
            return  # not a packed forward: check the next one
        # A module counts as routed when it, or a module inside it, called the packed attention.
        silent = sorted(
            {
                type(module).__name__
                for module in self.ran.values()
                if not any(id(inner) in self.called for inner in module.modules())
            }
        )
        if silent:  # stays armed: every packed forward of this model raises until it is fixed
            self.ran, self.called = {}, set()
            raise UnsupportedArchitecture(
                f"{type(model).__name__}: {', '.join(silent)} computed attention without transformers' "
                f"AttentionInterface, so it would attend across the packed documents. {TRAIN_UNPACKED}"
            )
        self.verified |= set(self.ran)
        self.ran, self.called = {}, set()
        if self.verified >= self.expected:
            self.remove()  # every attention module seen routed: the steps that follow pay nothing

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []
        if self._called in ATTENTION_CALL_LISTENERS:
            ATTENTION_CALL_LISTENERS.remove(self._called)


def _takes_position_ids(model: torch.nn.Module) -> bool:

    try:
        parameters = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return True  # cannot tell: the run-time guards still apply
    return "position_ids" in parameters or any(p.kind is p.VAR_KEYWORD for p in parameters.values())


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
    attention_modules: list[torch.nn.Module] = []
    if not getattr(model, "_supports_attention_backend", False):
        # transformers does not promise that this model's attention goes through its
        # AttentionInterface. Hybrids say so because of their Mamba / linear-attention layers,
        # which the per-document adaptation handles: accept a hybrid that has attention
        # modules, and check on its packed forwards that every one of them calls slipstream's
        # attention (AttentionRouteCheck). Anything else stays refused.
        attention_modules = _attention_modules(model)
        position_bias = any(_POSITION_BIAS.search(type(m).__name__) for m in model.modules())
        if not attention_modules or not find_token_mixers(model) or position_bias:
            raise UnsupportedArchitecture(
                f"{name} does not route attention through transformers' AttentionInterface, so slipstream "
                f"cannot plug packed attention into it. {TRAIN_UNPACKED}",
                refused=f"{name}'s attention outside transformers' AttentionInterface",
            )
    if not _takes_position_ids(model):
        raise UnsupportedArchitecture(
            f"{name}.forward does not take position_ids, so positions cannot restart at each packed document. "
            + TRAIN_UNPACKED,
            refused=f"{name} without position_ids",
        )
    if getattr(config, "is_encoder_decoder", False) or not getattr(config, "is_causal", True):
        raise UnsupportedArchitecture(
            f"{name}: packed attention is for causal decoder-only models. {TRAIN_UNPACKED}",
            refused=f"packed attention for {name}, not a causal decoder-only model",
        )
    for key in ("attn_logit_softcapping", "attention_logit_softcapping"):
        softcap = getattr(config, key, None) or getattr(config.get_text_config(), key, None)
        if softcap:
            raise UnsupportedArchitecture(
                f"{name} uses attention logit softcapping ({key}={softcap}); slipstream's packed attention does "
                f"not implement it and will not compute something else. {TRAIN_UNPACKED}",
                refused=f"{name}'s attention logit softcapping on packed rows",
            )
    text_config = config.get_text_config()
    chunk = getattr(text_config, "attention_chunk_size", None)
    if chunk and "chunked_attention" not in (getattr(text_config, "layer_types", None) or ()):
        raise UnsupportedArchitecture(
            f"{name} sets attention_chunk_size={chunk} without naming its chunked layers in layer_types, so "
            f"slipstream cannot tell which layers chunk. {TRAIN_UNPACKED}",
            refused=f"{name}'s chunked attention without layer_types",
        )
    indexers = _sparse_indexers(model)
    if indexers:
        raise UnsupportedArchitecture(
            f"{name} selects attention keys with a sparse-attention indexer ({', '.join(indexers)}) that reads the "
            f"model's own mask over the whole row; slipstream does not split it per document. {TRAIN_UNPACKED}",
            refused=f"{name}'s sparse-attention indexer on packed rows",
        )
    return ArchitectureVerdict(
        name,
        mixers=find_token_mixers(model),
        position_offset=_position_offset(model),
        attention_chunk=chunk if chunk else None,
        attention_to_verify=attention_modules,
        row_features=row_position_features(model),
    )


# --------------------------------------------------------------------------- adaptations


# Keyword arguments that describe the whole packed row (its batch, its varlen boundaries): a
# mixer run on one document alone must not see them.
_ROW_KWARGS = frozenset(
    {
        PACKED_BATCH_KWARG,
        "cu_seq_lens_q",
        "cu_seq_lens_k",
        "max_length_q",
        "max_length_k",
        "cu_seqlens",
        "seq_idx",
    }
)


def _take_tokens(value, ranges: list[tuple[int, int]], length: int):
    """``value`` cut to the tokens of ``ranges`` (joined in order) where it is laid out per token:
    pairwise ([..., T, T], e.g. relative distances or a bias) on both token axes, else per token on
    dim 1. A document that attends to a shared prompt runs on the prompt's tokens, then its own."""
    if isinstance(value, tuple | list):
        return type(value)(_take_tokens(v, ranges, length) for v in value)
    if not isinstance(value, torch.Tensor) or value.dim() < 2 or value.shape[0] != 1:
        return value
    (start, end), *more = ranges
    if value.dim() >= 3 and tuple(value.shape[-2:]) == (length, length):
        if not more:
            return value[..., start:end, start:end]
        index = torch.cat([torch.arange(s, e, device=value.device) for s, e in ranges])
        return value.index_select(-1, index).index_select(-2, index)
    if value.shape[1] == length:
        return torch.cat([value[:, s:e] for s, e in ranges], dim=1) if more else value[:, start:end]
    return value


def _without_prefix(output, prefix: int):
    """A mixer's output on prompt + document, cut to the document's own tokens."""
    if not prefix:
        return output
    if isinstance(output, torch.Tensor):
        return output[:, prefix:]
    if isinstance(output, tuple) and output and isinstance(output[0], torch.Tensor):
        return (output[0][:, prefix:], *output[1:])
    return output


def _per_document_forward(module: torch.nn.Module, forward: Callable) -> Callable:
    def run(*args, **kwargs):
        batch: PackedBatch | None = kwargs.get(PACKED_BATCH_KWARG) or active_batch()
        if batch is None or len(batch.seq_lens) == 1:
            return forward(*args, **kwargs)
        hidden = args[0] if args else kwargs.get("hidden_states")
        if not isinstance(hidden, torch.Tensor) or hidden.dim() != 3 or hidden.shape[1] != batch.num_tokens:
            # Not the packed token stream (an audio or vision tower's sequence): nothing to split.
            return forward(*args, **kwargs)
        if hidden.shape[0] != 1:
            raise UnsupportedArchitecture(
                f"{type(module).__name__} got hidden states of shape {tuple(hidden.shape)}; the per-document "
                f"adaptation needs one packed row [1, T, D]. {TRAIN_UNPACKED}"
            )
        length = hidden.shape[1]
        mask = kwargs.get("attention_mask")
        if isinstance(mask, torch.Tensor) and mask.dim() > 2:
            raise UnsupportedArchitecture(
                f"{type(module).__name__} was given a {mask.dim()}-D attention mask it would apply across the row. "
                + TRAIN_UNPACKED
            )
        pieces = []
        for (start, end), spans in zip(batch.doc_bounds(), batch.context_spans(), strict=True):
            # a document that attends to shared context (a preference pair's rejected answer,
            # :mod:`.pairs`; a group's continuation, :mod:`.groups`; a tree node, :mod:`.trees`): the
            # mixer runs causally over that context's tokens (a tree's ancestors, root first), then its own
            prefix = sum(e - s for s, e in spans)
            ranges = [*spans, (start, end)]
            doc_args = [_take_tokens(a, ranges, length) for a in args]
            doc_kwargs = {
                k: _take_tokens(v, ranges, length) for k, v in kwargs.items() if k not in _ROW_KWARGS
            }
            with running_unpacked():  # an attention inside sees one document, causally
                pieces.append(_without_prefix(forward(*doc_args, **doc_kwargs), prefix))
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
    if verdict.attention_to_verify:
        check = AttentionRouteCheck(model, verdict.attention_to_verify)
        undo.append(check.remove)
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
    for feature in verdict.row_features:
        undo.append(feature.install())

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
