"""Values a model computes from the packed row instead of from each document's position_ids.

Packed, a document's tokens sit at row positions ``start .. end - 1`` while its position_ids
restart at 0. What a model reads from position_ids (RoPE angles, learned position embeddings,
a query scale computed from them) is therefore exact packed. What it reads from the row (an
``arange`` over the tokens, the row's length, the row's largest position) is not: each such
feature is found here, one small place per feature, and either adapted or refused.

* **Attention temperature tuning** (Llama 4): NoPE layers scale each query by
  ``log1p(floor((position + 1) / floor_scale)) * attn_scale + 1`` where ``position`` counts
  tokens in the row. While a packed batch runs, the model's own scaling is switched off for
  the call and slipstream's attention scales the queries by the same formula of each token's
  *document* position (the batch's position_ids, already on the device: no host sync).
* **longrope RoPE** (Phi-3 / Phi-4 long-context configs, any RoPE model configured so): the
  rotary module picks its long or short factors by ``max(position_ids) + 1`` of the whole row,
  i.e. by the longest packed document. Where the row holds documents on both sides of
  ``original_max_position_embeddings``, the rotary module runs once per run of neighbouring
  documents on the same side (chosen from the host lengths), so each gets the factors it
  would get alone.
* **dynamic NTK RoPE** (``rope_type="dynamic"``): the frequencies grow with the longest
  position seen (and stay grown between calls). Below ``max_position_embeddings`` nothing
  grows and packing is exact; a packed batch with a document that long is refused.

:data:`AUDIT` records what a read of every causal LM in transformers' registry found, and
what becomes of each finding; the compatibility sweep prints it in ``docs/compatibility.md``.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .batch import PACKED_BATCH_KWARG, PackedBatch, UnsupportedSharedPrefix
from .guards import TRAIN_UNPACKED, UnsupportedArchitecture, active_batch


@dataclass
class RowPositionFeature:
    """One feature of a model that reads the row, and how packed training handles it."""

    note: str  # the policy line ("adapted: ...")
    install: Callable[[], Callable[[], None]]  # installs the adaptation; returns its undo


def row_position_features(model: torch.nn.Module) -> list[RowPositionFeature]:
    """The row-position features of ``model`` that need an adaptation (or a guard)."""
    return [*_temperature_tuning(model), *_rope_by_length(model)]


# --------------------------------------------------------------------------- Llama 4 temperature tuning

# Attention modules whose next attention call must scale its queries by document position:
# armed by the module's forward pre-hook (with the model's own row scaling switched off for
# that call), disarmed by the attention call that applied the scale.
_ARMED: weakref.WeakKeyDictionary[torch.nn.Module, tuple[float, float]] = weakref.WeakKeyDictionary()
_SWITCHED_OFF: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()


def _tuned_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Llama 4 NoPE attention layers with temperature tuning on."""
    return [
        module
        for module in model.modules()
        if getattr(module, "attn_temperature_tuning", False) is True
        and hasattr(module, "floor_scale")
        and hasattr(module, "attn_scale")
        and not getattr(module, "use_rope", True)
    ]


def _temperature_tuning(model: torch.nn.Module) -> list[RowPositionFeature]:
    layers = _tuned_layers(model)
    if not layers:
        return []
    floor_scales = sorted({m.floor_scale for m in layers})

    def install() -> Callable[[], None]:
        handles = [module.register_forward_pre_hook(_arm, with_kwargs=True) for module in layers]
        handles += [module.register_forward_hook(_disarm, always_call=True) for module in layers]

        def undo() -> None:
            for handle in handles:
                handle.remove()

        return undo

    return [
        RowPositionFeature(
            f"adapted: attention temperature tuning (floor_scale={', '.join(map(str, floor_scales))}) on "
            f"{len(layers)} NoPE layer(s) scales each query by its position in its document, not in the "
            "packed row",
            install,
        )
    ]


def _arm(module: torch.nn.Module, args, kwargs):
    if kwargs.get(PACKED_BATCH_KWARG) is None:
        return None  # not packed: the model's own scaling is right
    module.attn_temperature_tuning = False  # for this call only: _disarm switches it back
    _SWITCHED_OFF.add(module)
    _ARMED[module] = (float(module.floor_scale), float(module.attn_scale))
    return None


def _disarm(module: torch.nn.Module, args, output):
    if module in _SWITCHED_OFF:
        _SWITCHED_OFF.discard(module)
        module.attn_temperature_tuning = True
    if _ARMED.pop(module, None) is not None:  # no packed attention call applied the scale
        raise UnsupportedArchitecture(
            f"{type(module).__name__}: its attention did not go through slipstream's packed attention, so "
            f"its temperature tuning could not follow each document's positions. {TRAIN_UNPACKED}"
        )
    return None


def document_temperature(module: torch.nn.Module, query: torch.Tensor, batch: PackedBatch) -> torch.Tensor:
    """``query`` ([1, H, T, D]) scaled as the module's temperature tuning would scale it for each
    document alone, when the module's forward armed it; else ``query`` as it is.

    The scales come from the batch's position_ids (on the device), once per batch."""
    params = _ARMED.pop(module, None)
    if params is None:
        return query
    floor_scale, attn_scale = params

    def build() -> torch.Tensor:
        positions = batch.position_ids.reshape(-1).float()
        scales = torch.log1p(torch.floor((positions + 1.0) / floor_scale)) * attn_scale + 1.0
        return scales.view(1, 1, -1, 1)

    scales = batch.memo(("document_temperature", floor_scale, attn_scale), build)
    return (query * scales).to(query.dtype)


# --------------------------------------------------------------------------- RoPE chosen by length


def _rope_types(module: torch.nn.Module) -> dict[str | None, str]:
    """A rotary module's RoPE type (per layer type where it has one per layer type)."""
    rope_type = getattr(module, "rope_type", None)
    if isinstance(rope_type, str):
        return {None: rope_type}
    if isinstance(rope_type, dict):
        return {k: v for k, v in rope_type.items() if isinstance(v, str)}
    return {}


def _rotary_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in model.modules() if type(m).__name__.endswith("RotaryEmbedding") and _rope_types(m)]


def _longrope_threshold(module: torch.nn.Module, layer_type: str | None) -> int:
    config = module.config
    parameters = getattr(config, "rope_parameters", None) or {}
    if layer_type is not None and isinstance(parameters.get(layer_type), dict):
        parameters = parameters[layer_type]
    value = parameters.get("original_max_position_embeddings") or getattr(
        config, "original_max_position_embeddings", None
    )
    return int(value)


def _dynamic_threshold(module: torch.nn.Module) -> int:
    return int(getattr(module, "original_max_seq_len", None) or module.config.max_position_embeddings)


def _runs(
    lengths: tuple[int, ...], side: Callable[[int], bool], alone: tuple[int, ...] | None = None
) -> list[tuple[int, int]]:
    """Token ranges of neighbouring documents on the same ``side`` (judged by each document's
    length ``alone``: with a shared prompt, its own tokens plus the prompt's)."""
    runs: list[tuple[int, int]] = []
    start, previous = 0, None
    for length, whole in zip(lengths, alone or lengths, strict=True):
        here = side(whole)
        if runs and here == previous:
            runs[-1] = (runs[-1][0], start + length)
        else:
            runs.append((start, start + length))
        start, previous = start + length, here
    return runs


def _cut(value, start: int, end: int, length: int):
    if isinstance(value, torch.Tensor) and value.shape[:2] == (1, length):  # [1, T, ...]
        return value[:, start:end]
    return value


def _join(pieces: list):
    first = pieces[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(pieces, dim=1)
    return type(first)(torch.cat(parts, dim=1) for parts in zip(*pieces, strict=True))


def _frequency_free_forward(module: torch.nn.Module) -> Callable | None:
    """The rotary module's forward without transformers' ``dynamic_rope_update`` decorator.

    That decorator picks the frequencies from ``max(position_ids) + 1``, a value on the device:
    transformers 5.17 compares it in Python (a host sync per layer call), 5.24 with ``torch.where``.
    Choosing the frequencies here, from the host lengths, and calling the undecorated forward is
    the same on every version and reads nothing back. ``None`` where the class's forward is not so
    decorated (a version that chooses otherwise): then its own forward runs.
    """
    function = type(module).forward
    for _ in range(4):  # torch.no_grad()'s wrapper, then the decorator's (functools.wraps both)
        inner = getattr(function, "__wrapped__", None)
        if inner is None:
            return None
        code = getattr(function, "__code__", None)  # functools.wraps copies the names, not the code
        if code is not None and code.co_filename.endswith("modeling_rope_utils.py"):
            break
        function = inner
    else:
        return None

    def forward(*args, **kwargs):
        with torch.no_grad():
            return inner(module, *args, **kwargs)

    return forward


_LONG_FREQUENCIES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _set_longrope_frequencies(module: torch.nn.Module, layer_type: str | None, long: bool, device) -> None:
    """Make the module's ``inv_freq`` buffer the long or the short longrope frequencies.

    A fresh copy, never written in place: transformers 5.17 makes the buffer *be* its
    ``original_inv_freq`` after a short call (so an in-place write would change the short set for
    good), 5.24 writes the buffer in place (so it must not be one of ours).
    """
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    prefix = "" if layer_type is None else f"{layer_type}_"
    if long:
        per_module = _LONG_FREQUENCIES.setdefault(module, {})
        if layer_type not in per_module:
            rope_type = _rope_types(module).get(layer_type, _rope_types(module).get(None))
            threshold = _longrope_threshold(module, layer_type)
            kwargs = {} if layer_type is None else {"layer_type": layer_type}
            per_module[layer_type], _ = ROPE_INIT_FUNCTIONS[rope_type](
                module.config, device, seq_len=threshold + 1, **kwargs
            )
        frequencies = per_module[layer_type]
    else:
        frequencies = getattr(module, f"{prefix}original_inv_freq")
    dtype = getattr(module, f"{prefix}inv_freq").dtype
    module.register_buffer(
        f"{prefix}inv_freq", frequencies.to(device=device, dtype=dtype).clone(), persistent=False
    )


def _dynamic_is_original(module: torch.nn.Module, layer_type: str | None) -> bool:
    """Dynamic RoPE's frequencies are the original ones (never grown, or reset since)."""
    prefix = "" if layer_type is None else f"{layer_type}_"
    cached = getattr(module, f"{prefix}max_seq_len_cached", getattr(module, "max_seq_len_cached", None))
    original = getattr(module, "original_max_seq_len", None)
    return cached is not None and original is not None and cached <= original


def _length_aware_forward(module: torch.nn.Module, forward: Callable) -> Callable:
    types = _rope_types(module)
    undecorated = _frequency_free_forward(module)

    def run(*args, **kwargs):
        batch = active_batch()
        if batch is None:
            return forward(*args, **kwargs)
        layer_type = kwargs.get("layer_type", args[2] if len(args) > 2 else None)
        rope_type = types.get(layer_type, types.get(None, ""))
        longest = max(batch.alone_lengths)  # a shared prompt's answer is as long as prompt + answer
        if "dynamic" in rope_type:
            threshold = _dynamic_threshold(module)
            if longest >= threshold:
                raise UnsupportedArchitecture(
                    f"{type(module).__name__}: dynamic RoPE scaling (rope_type={rope_type!r}) recomputes its "
                    f"frequencies from the largest position in the whole packed row, so a document of {longest} "
                    f"tokens (max_position_embeddings is {threshold}) would change the positions of every other "
                    f"document in its row. {TRAIN_UNPACKED}"
                )
            # every document below the threshold: the decorator would keep (or reset to) the original
            # frequencies; where they are already, skip its device-side comparison
            if undecorated is not None and _dynamic_is_original(module, layer_type):
                return undecorated(*args, **kwargs)
            return forward(*args, **kwargs)
        if rope_type != "longrope":
            return forward(*args, **kwargs)
        threshold = _longrope_threshold(module, layer_type)
        if batch.has_prefixes:
            # a shared prefix is rotated once, with its source document's factors: exact only when
            # every continuation that shares it falls on the same side of the threshold (run alone,
            # prefix + continuation rotates every position, the prefix's too, with the factors of
            # its own length)
            # (a tree node: every ancestor on the same side as it, so every row through a node is)
            alone = batch.alone_lengths
            for number, sources in enumerate(batch.context_sources()):
                source = next(
                    (s for s, _ in sources if (alone[number] > threshold) != (alone[s] > threshold)), None
                )
                if source is not None:
                    raise UnsupportedSharedPrefix(
                        f"{type(module).__name__}: longrope rotates a sequence with the factors of its length, "
                        f"and two sequences that share a prompt or prefix ({alone[source]} and {alone[number]} "
                        "tokens: a pair's prompt + chosen and prompt + rejected, or a group's prefix + "
                        f"continuations) fall on either side of {threshold}, so they cannot share one prompt: "
                        "set preference.prefix_sharing false (prefix groups: collate_groups(..., "
                        "prefix_sharing=False))",
                        refused="longrope with a shared prompt on either side of its threshold",
                    )
        runs = _runs(batch.seq_lens, lambda length: length > threshold, batch.alone_lengths)
        position_ids = kwargs.get("position_ids", args[1] if len(args) > 1 else None)
        x = kwargs.get("x", args[0] if args else None)
        total = batch.num_tokens
        if undecorated is None:
            if len(runs) == 1:
                return forward(*args, **kwargs)  # every document on one side: the row's choice is each one's
            call = forward
        else:
            call = undecorated
        if len(runs) == 1:
            _set_longrope_frequencies(module, layer_type, batch.alone_lengths[0] > threshold, x.device)
            return call(*args, **kwargs)
        if not isinstance(position_ids, torch.Tensor) or tuple(position_ids.shape) != (1, total):
            raise UnsupportedArchitecture(
                f"{type(module).__name__}: longrope picks its factors from the longest document of the packed row, "
                f"and slipstream splits it per document only for position_ids of shape (1, {total}). {TRAIN_UNPACKED}"
            )
        first_long = batch.alone_lengths[0] > threshold
        pieces = []
        for index, (start, end) in enumerate(runs):  # neighbouring runs are on alternate sides
            piece_args = [_cut(a, start, end, total) for a in args]
            piece_kwargs = {k: _cut(v, start, end, total) for k, v in kwargs.items()}
            if undecorated is not None:
                _set_longrope_frequencies(module, layer_type, first_long != (index % 2 == 1), x.device)
            pieces.append(call(*piece_args, **piece_kwargs))
        return _join(pieces)

    return run


def _rope_by_length(model: torch.nn.Module) -> list[RowPositionFeature]:
    features = []
    for module in _rotary_modules(model):
        kinds = set(_rope_types(module).values())
        longrope = [layer_type for layer_type, kind in _rope_types(module).items() if kind == "longrope"]
        notes = []
        if longrope:
            thresholds = sorted({_longrope_threshold(module, layer_type) for layer_type in longrope})
            notes.append(
                f"adapted: longrope picks long or short factors per document (longer than "
                f"{', '.join(map(str, thresholds))} tokens or not), not by the longest document of the packed row"
            )
        if any("dynamic" in kind for kind in kinds):
            notes.append(
                f"guarded: dynamic RoPE scaling is exact while every packed document is shorter than "
                f"{_dynamic_threshold(module)} tokens (max_position_embeddings); a batch with a longer one is refused"
            )
        if not notes:
            continue

        def install(module=module) -> Callable[[], None]:
            if "forward" in vars(module):  # already adapted
                return lambda: None
            module.forward = _length_aware_forward(module, module.forward)
            return lambda: vars(module).pop("forward", None)

        features.append(RowPositionFeature(notes[0], install))
        features += [RowPositionFeature(note, lambda: lambda: None) for note in notes[1:]]
    return features


# --------------------------------------------------------------------------- the audit


@dataclass(frozen=True)
class Finding:
    """One row-position feature found in transformers' causal LMs, and its outcome packed."""

    feature: str
    model_types: str
    outcome: str  # "exact" | "adapted" | "guarded" | "refused"
    why: str


# What a read of every causal LM in transformers 5.24's registry found in the training forward:
# values computed from the row position (an arange over the tokens, the row's length, its largest
# position) rather than from position_ids. The sweep's tiny configs put each threshold named here
# inside the test documents' lengths, so a regression shows as WRONG.
AUDIT: tuple[Finding, ...] = (
    Finding(
        "attention temperature tuning (`attn_temperature_tuning`, `floor_scale`, `attn_scale`) on NoPE layers",
        "llama4, llama4_text",
        "adapted",
        "the model scales queries by the row position (an arange over the tokens); while a packed batch runs "
        "slipstream's attention scales them by each token's position_id instead (the model's own scaling off for "
        "the call)",
    ),
    Finding(
        "longrope RoPE: long or short factors chosen by `max(position_ids) + 1` against "
        "`original_max_position_embeddings`",
        "phi3, phi4_multimodal (long-context configs); any RoPE model with `rope_type: longrope`",
        "adapted",
        "packed, that is the longest document of the row; the rotary module runs once per run of documents on the "
        "same side of the threshold (from the host lengths)",
    ),
    Finding(
        "longrope with short / long `mscale` chosen by the longest position",
        "phimoe",
        "refused",
        "already refused for its config-only sliding window; its rotary module would get the longrope adaptation",
    ),
    Finding(
        "dynamic NTK RoPE: frequencies regrown from `max(position_ids) + 1`, kept between calls",
        "any RoPE model with `rope_type: dynamic` (hunyuan_v1_dense / hunyuan_v1_moe with `alpha` are static)",
        "guarded",
        "below `max_position_embeddings` nothing grows and packing is exact; a packed batch with a document that "
        "long is refused by name",
    ),
    Finding(
        "Llama-4-style query scaling `1 + beta * log(1 + floor(position / original_max_position_embeddings))`",
        "ministral3",
        "exact",
        "computed from position_ids, which restart at every document",
    ),
    Finding(
        "scalable-softmax query scale `(1 + (position + 1) / 2048) ** 0.1` on NoPE layers",
        "beam",
        "exact",
        "computed from position_ids",
    ),
    Finding(
        "query / position-bias log scaling from an arange over the row (`log_scaling_n_floor`), relative "
        "position bias over the row",
        "inkling_text, inkling2_text, inkling2_loop_text",
        "refused",
        "already refused: their attention does not go through transformers' AttentionInterface",
    ),
    Finding(
        "ALiBi built from an arange or the mask's cumsum over the row; relative-position buckets over the row",
        "bloom, mpt, falcon (`alibi`), cpmant, prophetnet, xlnet",
        "refused",
        "already refused: their attention does not go through transformers' AttentionInterface",
    ),
    Finding(
        "learned / sinusoidal decoder positions from `arange(T) + cache length`, whatever position_ids say",
        "bart, mbart, blenderbot, blenderbot-small, pegasus, plbart, marian, bigbird_pegasus",
        "refused",
        "already refused: their attention does not go through transformers' AttentionInterface",
    ),
    Finding(
        "axial position embeddings sized by the row's largest position (`position_ids.max()`)",
        "reformer",
        "refused",
        "already refused: its attention does not go through transformers' AttentionInterface",
    ),
    Finding(
        "default `position_ids = arange(T) + cache length` (and M-RoPE's `get_rope_index`) when none are given",
        "every decoder",
        "exact",
        "packed batches always pass position_ids",
    ),
    Finding(
        "positions from the padding mask's cumsum, counted from `padding_idx + 1`",
        "roberta family (roberta, xlm-roberta, camembert, data2vec-text, xmod, ...)",
        "adapted",
        "position_ids are given, shifted by `padding_idx + 1` (the existing position-offset adaptation)",
    ),
    Finding(
        "sliding-window and chunked attention spans",
        "mistral, qwen2, gemma3, llama4, ... (see the table)",
        "adapted",
        "applied per document by the packed backends (windows of 8 in the sweep)",
    ),
)


__all__ = [
    "AUDIT",
    "Finding",
    "RowPositionFeature",
    "document_temperature",
    "row_position_features",
]
