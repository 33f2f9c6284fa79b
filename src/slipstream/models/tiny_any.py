"""A tiny, randomly initialised version of any causal LM in transformers' registry.

``tiny_config(model_type)`` starts from ``AutoConfig.for_model(model_type)`` (the family's
defaults, i.e. a full-size model) and shrinks it: width 64, 2 layers (or as many as it takes
to have one of each layer kind a hybrid mixes), 4 heads / 2 kv heads where the family has
GQA, small MLPs, vocabulary 256, 8 experts top-2, small state and conv sizes for recurrent
mixers. A generic shrinker handles the attributes most configs share; ``OVERRIDES`` holds
what a few families need on top. Special features are turned ON where a config has them, so
the tiny model exercises them at a few dozen tokens: sliding windows of 8, chunked attention
of 8, small linear-attention / SSM chunks, attention sinks given non-zero values, soft-capping
kept at its default. Dropout (and router jitter) is set to 0 and ``use_cache`` off, so a
training-mode forward is deterministic.

Composite (multimodal) configs are shrunk level by level: the text config and the vision /
audio towers alike (the towers are built but never fed). ``tiny_model`` builds the class the
causal-LM registry names for ``model_type``, handing it the text config when that class takes
a text config rather than the composite one.

The generic shrinker passes only a config's own fields, so what ``__post_init__`` derives
(an MLA head dim, layer types from a window-layer count, ...) is derived again from the tiny
values. Per-layer lists are cut to the layers kept, lists of layer indices (``moe_layers``,
``cross_attention_layers``) renumbered, and a heterogeneous config's ``per_layer_config`` kept
for those layers, each layer shrunk in proportion to the global (a global-attention layer with
twice the head dim keeps twice it).

Nothing is downloaded; the weights come from the model's own initialisation under ``seed``.
Known limits (transformers 5.24): ``gemma3n``'s vision tower is a timm model, so it builds only
where timm is installed; ``musicgen`` / ``musicgen_melody`` take one id row per codebook and
labels shaped ``[batch, length, codebooks]``, and the Gemma 4 drafters
(``gemma4_assistant``, ``gemma4_unified_assistant``) take their target's embeddings and KV
states rather than ids, so those build but do not train on plain ``input_ids`` / ``labels``.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import torch

WIDTH = 64
HEADS = 4
KV_HEADS = 2
HEAD_DIM = 16
FFN = 128
EXPERT_FFN = 32
VOCAB = 256
EXPERTS = 8
TOP_K = 2
WINDOW = 8  # sliding / chunked attention window: smaller than most test documents
STATE = 8  # SSM / recurrent state size
CHUNK = 8  # scan / linear-attention chunk: documents span several chunks
MAX_POSITIONS = 512
# Thresholds on a token's position or a document's length (Llama 4's temperature ``floor_scale``,
# longrope's ``original_max_position_embeddings``, ...): inside the range of the test documents'
# lengths and below a packed row's, so a value taken from the row instead of the document differs.
POSITION_THRESHOLD = 16
DYNAMIC_ROPE_POSITIONS = 32  # max_position_embeddings of the dynamic-RoPE model: above every test document
# Ids 0..RESERVED_LOW-1 are pad / bos / eos; the top RESERVED_HIGH ids are given to the other
# special tokens (image, audio, ...). Test documents use ids in between.
RESERVED_LOW = 3
RESERVED_HIGH = 16

# --------------------------------------------------------------------------- generic shrink table
# attribute -> target value. An int attribute is only ever made smaller, never larger.
_WIDTH_KEYS = (
    "hidden_size",
    "d_model",
    "n_embd",
    "embed_dim",
    "emb_dim",
    "embedding_dim",
    "dim",
    "model_dim",
    "hidden_size_global",
    "backbone_hidden_size",  # a drafter's target model's width
    # vision / audio adapters: the tower's width in, the text model's out
    "adapter_in_dim",
    "adapter_input_size",
    "adapter_out_dim",
)
_FFN_KEYS = (
    "intermediate_size",
    "ffn_dim",
    "decoder_ffn_dim",
    "encoder_ffn_dim",
    "n_inner",
    "ffn_hidden_size",
    "feed_forward_size",
    "dff",
    "dim_ff",
    "d_inner",
    "intermediate_size_mlp",
    "dense_intermediate_size",
    "d_ff",
)
_EXPERT_FFN_KEYS = (
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
    "moe_shared_expert_intermediate_size",
    "shared_intermediate_size",
    "shared_experts_intermediate_size",
    "expert_ffn_hidden_size",
)
_HEAD_KEYS = (
    "num_attention_heads",
    "n_head",
    "n_heads",
    "num_heads",
    "attention_heads",
    "decoder_attention_heads",
    "encoder_attention_heads",
    "num_decoder_attention_heads",
    "num_encoder_attention_heads",
    "swa_num_attention_heads",
)
# kv-head attributes and the head attribute they pair with (to tell GQA from MHA).
_KV_HEAD_KEYS = {
    "num_key_value_heads": "num_attention_heads",
    "num_kv_heads": "num_attention_heads",
    "swa_num_key_value_heads": "swa_num_attention_heads",
    "num_query_groups": "num_attention_heads",
    "multi_query_group_num": "num_attention_heads",
}
_HEAD_DIM_KEYS = (
    "head_dim",
    "swa_head_dim",
    "attention_head_dim",
    "kv_channels",
    "linear_key_head_dim",
    "linear_value_head_dim",
    "linear_head_dim",
    "dim_head",
    "attention_head_size",
    "d_head",
    "index_head_dim",
)
_SMALL: dict[str, int] = {
    # MLA (DeepSeek-style) ranks and split head dims
    "q_lora_rank": 32,
    "kv_lora_rank": 16,
    "o_lora_rank": 16,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8,
    "v_head_dim": 16,
    "qk_head_dim": 16,
    "query_pre_attn_scalar": HEAD_DIM,  # Gemma 2 / 3: the head dim
    # sparse-attention indexers
    "index_n_heads": 2,
    "index_topk": 8,
    # experts
    "num_experts": EXPERTS,
    "num_local_experts": EXPERTS,
    "n_routed_experts": EXPERTS,
    "moe_num_experts": EXPERTS,
    "num_experts_per_tok": TOP_K,
    "num_experts_per_token": TOP_K,
    "moe_topk": TOP_K,
    "moe_k": TOP_K,
    "n_shared_experts": 1,
    "num_shared_experts": 1,
    "moe_num_shared_experts": 1,
    "n_group": 2,
    "num_expert_group": 2,
    "topk_group": 1,
    "first_k_dense_replace": 1,
    "num_dense_layers": 1,
    "router_hidden_size": 32,
    "zero_expert_num": 2,  # LongCat's zero-computation experts
    # linear attention / gated delta net
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_num_heads": 4,
    # SSM / recurrent mixers
    "mamba_d_state": STATE,
    "ssm_state_size": STATE,
    "state_size": STATE,
    "d_state": STATE,
    "mamba_n_heads": 4,
    "mamba_num_heads": 4,
    "n_mamba_heads": 2,
    "mamba_d_head": 32,
    "mamba_head_dim": 32,
    "mamba_headdim": 32,
    "mamba_n_groups": 1,
    "mamba_ngroups": 1,
    "n_groups": 1,
    "mamba_chunk_size": CHUNK,
    "mamba_dt_rank": 8,
    "time_step_rank": 8,
    "chunk_size": CHUNK,
    "lru_width": WIDTH,
    "rotary_dim": 8,  # partial rotary (GPT-J style): half of HEAD_DIM
    "attention_hidden_size": 2 * WIDTH,
    "adapter_rank": 8,
    "laurel_rank": 8,
    # positions, vocabularies
    "max_position_embeddings": MAX_POSITIONS,
    "n_positions": MAX_POSITIONS,
    "n_ctx": MAX_POSITIONS,
    "max_target_positions": MAX_POSITIONS,
    "max_source_positions": MAX_POSITIONS,
    "vocab_size": VOCAB,
    "unpadded_vocab_size": VOCAB,
    "decoder_vocab_size": VOCAB,
    # per-layer input embeddings (Gemma 3n / 4)
    "vocab_size_per_layer_input": VOCAB,
    "hidden_size_per_layer_input": 16,
    "output_vocab_size": VOCAB,
    "num_logits_to_keep": 1,
    "pretraining_tp": 1,
}
# Attributes holding a layer count (the first one present is the config's layer count).
_LAYER_KEYS = (
    "num_hidden_layers",
    "n_layer",
    "n_layers",
    "num_layers",
    "decoder_layers",
    "num_decoder_layers",
    "num_blocks",
)
_SECONDARY_LAYER_KEYS = ("encoder_layers", "num_encoder_layers")
# Sliding windows and similar local-attention spans, set to WINDOW when the config has one.
_WINDOW_KEYS = (
    "sliding_window",
    "sliding_window_size",
    "attention_window_size",
    "attention_chunk_size",
    "local_attention_window_len",
    "keep_window_size",
)
# Token-id attributes: pad / bos / eos get the low reserved ids, every other special id one of
# the top RESERVED_HIGH ids (so random document ids never hit them).
_LOW_IDS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, "decoder_start_token_id": 1}
# Routed-expert counts, and the router top-k attributes that go with them.
_EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
_TOP_K_KEYS = ("num_experts_per_tok", "num_experts_per_token", "moe_topk", "moe_k", "top_k_experts")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _shrink(attrs: dict[str, Any], key: str, target: int, out: dict[str, Any]) -> None:
    value = attrs.get(key)
    if _is_int(value) and value > target:
        out[key] = target


def _read_attrs(config) -> dict[str, Any]:
    """The config's attributes; per-layer attributes of a heterogeneous config read as their global value."""
    read = getattr(config, "_getattr_without_heterogeneous_validation", None)
    attrs: dict[str, Any] = {}
    for key in config.to_dict():
        if key == "per_layer_config":
            continue
        with contextlib.suppress(AttributeError):
            attrs[key] = read(key) if read is not None else getattr(config, key)
    return attrs


def _per_layer_overrides(config) -> dict[int, dict[str, Any]]:
    """A heterogeneous config's per-layer attribute overrides (layer index -> attribute -> value)."""
    spec = config.__dict__.get("_heterogeneity_spec")
    return copy.deepcopy(spec.per_layer_overrides) if spec is not None else {}


def _layer_count(attrs: dict[str, Any]) -> tuple[str | None, int | None]:
    for key in _LAYER_KEYS:
        if _is_int(attrs.get(key)):
            return key, attrs[key]
    return None, None


def _is_index_list(value: Any, n_layers: int) -> bool:
    """A list of distinct layer indices (``moe_layers``, ``full_attn_idxs``, ...), not one entry per layer."""
    return (
        isinstance(value, list)
        and len(value) > 1
        and all(_is_int(v) and 0 <= v < n_layers for v in value)
        and value == sorted(set(value))
        and (len(value) < n_layers or value == list(range(n_layers)))
    )


def _per_layer_lists(attrs: dict[str, Any], n_layers: int) -> dict[str, list]:
    """Attributes that list one entry per layer (layer_types, mlp_layer_types, ...)."""
    return {
        key: value
        for key, value in attrs.items()
        if isinstance(value, list)
        and len(value) == n_layers
        and n_layers > 1
        and not key.startswith("_")
        and not _is_index_list(value, n_layers)
    }


def _choose_layers(kinds: list[list], n_layers: int, minimum: int) -> list[int]:
    """Original layer indices to keep: the first of every distinct value of every per-layer list.

    A hybrid's tiny version so keeps one layer of each kind (sliding and full attention,
    mamba and attention, dense and sparse MLP), in the original order.
    """
    keep: set[int] = set()
    for values in kinds:
        seen: set[str] = set()
        for index, value in enumerate(values):
            if repr(value) not in seen:
                seen.add(repr(value))
                keep.add(index)
    index = 0
    while len(keep) < min(minimum, n_layers):
        keep.add(index)
        index += 1
    return sorted(keep)


def _shrink_values(attrs: dict[str, Any]) -> dict[str, Any]:
    """Width, heads, MLP, expert, state and vocabulary sizes of one (flat) set of attributes."""
    out: dict[str, Any] = {}
    for key in _WIDTH_KEYS:
        _shrink(attrs, key, WIDTH, out)
    for key in _FFN_KEYS:
        _shrink(attrs, key, FFN, out)
    for key in _EXPERT_FFN_KEYS:
        _shrink(attrs, key, EXPERT_FFN, out)
    for key in _HEAD_DIM_KEYS:
        _shrink(attrs, key, HEAD_DIM, out)
    for key, target in _SMALL.items():
        _shrink(attrs, key, target, out)
    for key in _HEAD_KEYS:
        _shrink(attrs, key, HEADS, out)
    for key, head_key in _KV_HEAD_KEYS.items():
        kv, heads = attrs.get(key), attrs.get(head_key)
        if kv is None and key in attrs and _is_int(heads):  # unset: MHA
            out[key] = out.get(head_key, heads)
        if not _is_int(kv):
            continue
        if _is_int(heads) and kv >= heads:  # MHA stays MHA
            out[key] = out.get(head_key, heads)
        elif kv > 1:  # GQA stays GQA; MQA (1) stays MQA
            out[key] = min(kv, KV_HEADS)

    def tiny(key: str) -> Any:
        return out.get(key, attrs.get(key))

    # A head dim left to default (None: width / heads) is spelled out; an MLA config's head dim
    # that is its rotary part stays so.
    if "head_dim" in attrs and attrs["head_dim"] is None and _is_int(tiny("hidden_size")):
        heads = tiny("num_attention_heads")
        if _is_int(heads) and heads > 0:
            out["head_dim"] = tiny("hidden_size") // heads
    if _is_int(attrs.get("qk_rope_head_dim")) and attrs.get("head_dim") == attrs["qk_rope_head_dim"]:
        out["head_dim"] = tiny("qk_rope_head_dim")
    # A router top-k left unset next to a routed-expert count gets TOP_K.
    if any(_is_int(attrs.get(key)) and attrs[key] > 1 for key in _EXPERT_COUNT_KEYS):
        for key in _TOP_K_KEYS:
            if key in attrs and attrs[key] is None:
                out[key] = TOP_K
    return out


def _shrink_layer_overrides(
    attrs: dict[str, Any], tiny: dict[str, Any], overrides: dict[str, Any]
) -> dict[str, Any]:
    """One layer's attribute overrides, shrunk so the layer differs from the tiny global the way it
    differed from the full-size one (a full-attention layer with twice the head dim keeps twice it)."""
    shrunk = _shrink_values({**attrs, **overrides})
    out: dict[str, Any] = {}
    for key, value in overrides.items():
        full, small = attrs.get(key), tiny.get(key, attrs.get(key))
        if _is_int(value) and _is_int(full) and _is_int(small) and full > 0:
            scaled = small * value / full
            if scaled >= 1 and scaled == int(scaled):
                out[key] = int(scaled)
                continue
        out[key] = shrunk.get(key, value)
    return out


def shrink_kwargs(config, layers: int = 2) -> dict[str, Any]:
    """The keyword arguments that make ``config`` (one level, no sub-configs) tiny."""
    attrs = _read_attrs(config)
    out = _shrink_values(attrs)

    # Layers: keep one of each kind the per-layer lists (and per-layer overrides) tell apart,
    # at least ``layers``.
    key, n_layers = _layer_count(attrs)
    overrides = _per_layer_overrides(config)
    if key is not None and n_layers is not None:
        per_layer = _per_layer_lists(attrs, n_layers)
        index_lists = {
            name: value
            for name, value in attrs.items()
            if "layer" in name and name not in per_layer and _is_index_list(value, n_layers)
        }
        # A layer with overrides is of another kind than one without (the attributes overridden
        # tell kinds apart, not their values: a pyramid of expert counts is one kind).
        kinds = [*per_layer.values(), [sorted(overrides.get(i, {})) for i in range(n_layers)]]
        kinds += [[i in value for i in range(n_layers)] for value in index_lists.values()]
        keep = _choose_layers(kinds, n_layers, layers)
        out[key] = len(keep)
        for name, values in per_layer.items():
            out[name] = [values[i] for i in keep]
        for name, values in index_lists.items():
            out[name] = [new for new, old in enumerate(keep) if old in values]
        if overrides:
            out["per_layer_config"] = {
                new: _shrink_layer_overrides(attrs, out, overrides[old])
                for new, old in enumerate(keep)
                if old in overrides
            }
        # KV sharing across all layers (a drafter reusing its target's cache) stays all layers.
        shared = attrs.get("num_kv_shared_layers")
        if _is_int(shared) and shared >= n_layers:
            out["num_kv_shared_layers"] = len(keep)
        # Sliding windows from a layer index on (Qwen2-style ``max_window_layers``): from the
        # second layer on, so the tiny model has both kinds; the layer types are derived again.
        if _is_int(attrs.get("max_window_layers")) and "sliding_window" in attrs:
            out["max_window_layers"] = 1
            out.pop("layer_types", None)
    for key in _SECONDARY_LAYER_KEYS:
        _shrink(attrs, key, layers, out)

    # Features on: a small window wherever the config has one.
    for key in _WINDOW_KEYS:
        if key in attrs and (attrs[key] is None or _is_int(attrs[key])):
            out[key] = WINDOW
    if "use_sliding_window" in attrs:
        out["use_sliding_window"] = True
    # Determinism: no dropout, no router noise, no stochastic depth.
    for key, value in attrs.items():
        lowered = key.lower()
        is_drop = (
            "dropout" in lowered or "pdrop" in lowered or "layerdrop" in lowered or "drop_path" in lowered
        )
        if (is_drop or "jitter" in lowered) and isinstance(value, float) and value != 0.0:
            out[key] = 0.0
    if "use_cache" in attrs:
        out["use_cache"] = False
    if attrs.get("output_router_logits"):
        out["output_router_logits"] = False  # the aux loss is a batch statistic, not per document
    # Special token ids inside the tiny vocabulary.
    vocab = out.get("vocab_size", attrs.get("vocab_size"))
    if _is_int(vocab):
        high = iter(range(vocab - 1, vocab - RESERVED_HIGH - 1, -1))
        for key, value in attrs.items():
            if not (key.endswith("_token_id") or key.endswith("_token_index")):
                continue
            if isinstance(value, list):
                out[key] = [_LOW_IDS.get(key, 2)] if value else value
            elif _is_int(value):
                out[key] = _LOW_IDS[key] if key in _LOW_IDS else next(high, vocab - 1)
    # Attributes the config derives in ``__post_init__`` (``head_dim`` from ``qk_rope_head_dim``,
    # ...) are left to be derived again from the shrunk fields: passed as keywords they would
    # override the derivation. An attribute the config stores under an ``attribute_map`` alias
    # is passed under the alias's field name.
    fields = _init_fields(config)
    if fields is not None:
        fields.add("per_layer_config")
        aliases = {target: alias for alias, target in config.attribute_map.items() if alias in fields}
        out = {aliases.get(key, key): value for key, value in out.items() if key in fields or key in aliases}
    return out


def _init_fields(config) -> set[str] | None:
    """The keyword fields of a dataclass config (None for a config that is not a dataclass)."""
    if not dataclasses.is_dataclass(config):
        return None
    return {field.name for field in dataclasses.fields(config) if field.init}


# --------------------------------------------------------------------------- per-family overrides
# model_type -> a function (default config, kwargs from the generic shrinker) -> kwargs to use.
Override = Callable[[Any, dict[str, Any]], dict[str, Any]]
OVERRIDES: dict[str, Override] = {}


def _override(*model_types: str) -> Callable[[Override], Override]:
    def register(fn: Override) -> Override:
        for model_type in model_types:
            OVERRIDES[model_type] = fn
        return fn

    return register


# Default-config keyword arguments for families whose bare defaults don't validate.
_DEFAULT_KWARGS: dict[str, dict[str, Any]] = {
    # A drafter: its text config must have no per-layer inputs (Gemma 4 E2B's default has them).
    "gemma4_assistant": {"text_config": {"hidden_size_per_layer_input": 0, "vocab_size_per_layer_input": 0}},
}


def _layout(kwargs: dict[str, Any], count_key: str = "num_hidden_layers", **pattern: list) -> dict[str, Any]:
    """Per-layer lists (``layer_types=[...]``, ...) spelled out as ``pattern`` repeated over the
    layers: as many as the generic shrinker kept, at least one pattern's worth."""
    period = max(len(values) for values in pattern.values())
    n_layers = max(period, kwargs.get(count_key) or 0)
    out = {**kwargs, count_key: n_layers}
    for key, values in pattern.items():
        out[key] = [values[i % len(values)] for i in range(n_layers)]
    return out


def _without(kwargs: dict[str, Any], *keys: str) -> dict[str, Any]:
    """``kwargs`` without ``keys`` (left to the config to derive again)."""
    return {key: value for key, value in kwargs.items() if key not in keys}


@_override("bamba")
def _bamba(default, kwargs):
    return {**kwargs, "attn_layer_indices": [1]}  # the default is Mamba layers only


@_override("blt")
def _blt(default, kwargs):
    # The hash n-gram embeddings are 6 tables of 500k rows by default.
    return {**kwargs, "encoder_hash_byte_group_vocab": 64, "encoder_hash_byte_group_size": [3, 4]}


@_override("cohere_compass_text")
def _cohere_compass(default, kwargs):
    # The default has full-attention layers only and no RoPE parameters for them; North has
    # sliding layers with (M-)RoPE and NoPE full-attention layers.
    section = [HEAD_DIM // 4, HEAD_DIM // 8, HEAD_DIM // 8]  # sums to HEAD_DIM / 2
    rope = {"rope_type": "default", "rope_theta": 10_000.0, "mrope_section": section}
    kwargs = _layout(kwargs, layer_types=["sliding_attention", "full_attention"])
    return {**kwargs, "rope_parameters": {"sliding_attention": rope, "full_attention": None}}


@_override("cpmant")
def _cpmant(default, kwargs):
    # The input embedding has ``prompt_types * prompt_length`` prompt rows past the vocabulary;
    # kept within the reserved top ids so document ids stay inside the output vocabulary.
    return {**kwargs, "prompt_types": 3, "prompt_length": 4}


@_override("dbrx.attn_config")
def _dbrx_attention(default, kwargs):
    # DbrxAttention reads ``rope_theta`` off its attention config (released configs carry it).
    return {**kwargs, "kv_n_heads": KV_HEADS, "clip_qkv": 8.0, "rope_theta": 500_000.0}


@_override("dbrx.ffn_config")
def _dbrx_ffn(default, kwargs):
    return {**kwargs, "ffn_hidden_size": EXPERT_FFN, "moe_num_experts": EXPERTS, "moe_top_k": TOP_K}


@_override("deepseek_v2")
def _deepseek_v2(default, kwargs):
    # Group-limited routing (DeepSeek-V2's released configs) rather than the greedy default.
    return {**kwargs, "topk_method": "group_limited_greedy", "n_group": 2, "topk_group": 1}


@_override("dory")
def _dory(default, kwargs):
    # Input, recurrent (looped) and output sections; the recurrent one is what is left over.
    kwargs = _layout(kwargs, layer_types=["sliding_attention", "full_attention", "sliding_attention"])
    return {**_without(kwargs, "n_recurrent_layers"), "n_input_layers": 1, "n_output_layers": 1}


@_override("dots1")
def _dots1(default, kwargs):
    # The default leaves the MoE unset (a dense model); dots.llm1 routes 6 of 128 with 2 shared.
    return {
        **kwargs,
        "n_routed_experts": EXPERTS,
        "n_shared_experts": 1,
        "num_experts_per_tok": TOP_K,
        "first_k_dense_replace": 1,
    }


@_override("dots3_note_text")
def _dots3_note(default, kwargs):
    # The sliding-window layers' MLA head is qk_nope + qk_rope wide (a per-layer head dim the
    # global config doesn't have).
    rope = kwargs.get("qk_rope_head_dim", default.qk_rope_head_dim)
    per_layer = {
        index: {**layer, "head_dim": layer.get("qk_nope_head_dim", kwargs.get("qk_nope_head_dim")) + rope}
        for index, layer in kwargs.get("per_layer_config", {}).items()
    }
    return {**kwargs, "per_layer_config": per_layer}


def _kv_shared(kwargs: dict[str, Any], **pattern: list) -> dict[str, Any]:
    """Gemma 3n / 4 KV sharing: ``pattern`` over the layers, the later half of them reusing the
    cache of the last earlier layer of their kind (so both halves hold every kind)."""
    period = max(len(values) for values in pattern.values())
    n_layers = 2 * period * -(-kwargs.get("num_hidden_layers", 0) // (2 * period)) or 2 * period
    kwargs = _layout({**kwargs, "num_hidden_layers": n_layers}, **pattern)
    return {**kwargs, "num_kv_shared_layers": n_layers // 2}


@_override("gemma3n_text")
def _gemma3n_text(default, kwargs):
    kwargs = _kv_shared(kwargs, layer_types=["sliding_attention", "full_attention"])
    n_layers = kwargs["num_hidden_layers"]
    return {
        **kwargs,
        "intermediate_size": [FFN] * n_layers,
        "activation_sparsity_pattern": [0.95] + [0.0] * (n_layers - 1),  # sparse activations and dense
    }


def _gemma4_global_layers(kwargs: dict[str, Any], kv_heads: int | None) -> dict[str, Any]:
    """Full-attention layers with twice the head dim (and, with K=V attention, their own kv heads)."""
    layer = {"head_dim": 2 * HEAD_DIM} | ({"num_key_value_heads": kv_heads} if kv_heads else {})
    per_layer = {i: dict(layer) for i, kind in enumerate(kwargs["layer_types"]) if kind == "full_attention"}
    return {**kwargs, "per_layer_config": per_layer}


@_override("gemma4_text", "gemma4_unified_text")
def _gemma4_text(default, kwargs):
    # KV sharing with double-wide MLPs on the sharing layers (E2B), K=V global attention (31B),
    # and for Gemma 4 the MoE block (26B-A4B).
    kwargs = _kv_shared(kwargs, layer_types=["sliding_attention", "full_attention"])
    kwargs = {**kwargs, "use_double_wide_mlp": True, "attention_k_eq_v": True}
    if "enable_moe_block" in _init_fields(default):
        kwargs |= {
            "enable_moe_block": True,
            "num_experts": EXPERTS,
            "top_k_experts": TOP_K,
            "moe_intermediate_size": EXPERT_FFN,
        }
    return _gemma4_global_layers(kwargs, kv_heads=1)


@_override("gemma4_assistant.text_config", "gemma4_unified_assistant.text_config")
def _gemma4_assistant_text(default, kwargs):
    # A drafter: every layer reads its target's KV cache; no per-layer inputs, MoE or wide MLPs.
    kwargs = _layout(kwargs, layer_types=["sliding_attention", "full_attention"])
    kwargs = {**kwargs, "num_kv_shared_layers": kwargs["num_hidden_layers"]}
    return _gemma4_global_layers(kwargs, kv_heads=None)


@_override("git")
def _git(default, kwargs):
    # GitForCausalLM drops ``image_patch_tokens`` logits before the loss whether or not an image
    # was given; with no image embeddings that count is 0 and a text-only loss lines up.
    return {**kwargs, "num_image_with_embedding": 0}


@_override("gpt_neo")
def _gpt_neo(default, kwargs):
    pairs = -(-kwargs["num_layers"] // 2)
    return {
        **kwargs,
        "num_layers": 2 * pairs,
        "attention_types": [[["global", "local"], pairs]],
        "window_size": WINDOW,
    }


@_override("granitemoehybrid")
def _granitemoehybrid(default, kwargs):
    return _layout(kwargs, layer_types=["linear_attention", "full_attention"])  # default: Mamba only


@_override("hunyuan_v1_dense")
def _hunyuan_v1_dense(default, kwargs):
    # Dynamic NTK RoPE (the rope type Hunyuan's configs name; without ``alpha``, which would make it
    # static): its frequencies grow past max_position_embeddings, set here above every test
    # document and below a packed row, so only a model that took the row's length for a
    # document's would grow them.
    rope = {"rope_type": "dynamic", "rope_theta": 10_000.0, "factor": 2.0}
    return {**kwargs, "rope_parameters": rope, "max_position_embeddings": DYNAMIC_ROPE_POSITIONS}


@_override("hunyuan_v1_moe")
def _hunyuan_v1_moe(default, kwargs):
    return {**kwargs, "num_experts": EXPERTS, "moe_topk": TOP_K}  # the default is a single expert


@_override("inkling2_text", "inkling2_loop_text")
def _inkling2(default, kwargs):
    # Block attention residuals: a block boundary and a layer inside the block. A relative
    # position extent shorter than a document, so the bias's cut-off is exercised.
    return {**kwargs, "n_layers_per_attn_res_block": 2, "rel_extent": 2 * WINDOW}


@_override("jamba")
def _jamba(default, kwargs):
    return {**kwargs, "attn_layer_period": 2, "attn_layer_offset": 1}  # Mamba, attention, ...


@_override("laguna")
def _laguna(default, kwargs):
    kwargs = _layout(kwargs, layer_types=["sliding_attention", "full_attention"])
    return {**kwargs, "num_attention_heads_per_layer": [HEADS] * kwargs["num_hidden_layers"]}


@_override("lfm2", "lfm2_moe")
def _lfm2(default, kwargs):
    # Short-convolution and attention layers (LFM2's default is attention only, LFM2-MoE's unset).
    return _layout(kwargs, layer_types=["conv", "full_attention"])


@_override("llama4_text")
def _llama4_text(default, kwargs):
    # Dense and MoE layers interleaved (Maverick); the MoE layer list is derived again. The NoPE
    # layers' attention temperature changes every floor_scale tokens (8,192 in released configs).
    return {
        **_without(kwargs, "moe_layers"),
        "interleave_moe_layer_step": 2,
        "attn_temperature_tuning": True,
        "floor_scale": POSITION_THRESHOLD,
    }


def _longrope(default, kwargs: dict[str, Any], **extra: Any) -> dict[str, Any]:
    """Phi-3-style long-context RoPE (long or short factors by the longest position against
    ``original_max_position_embeddings``), its threshold at POSITION_THRESHOLD."""
    width = kwargs.get("hidden_size", default.hidden_size)
    heads = kwargs.get("num_attention_heads", default.num_attention_heads)
    rope = kwargs.get("rope_parameters", getattr(default, "rope_parameters", None)) or {}
    pairs = int(width // heads * rope.get("partial_rotary_factor", 1.0)) // 2
    rope = {
        **rope,
        "rope_type": "longrope",
        "short_factor": [1.0 + 0.1 * i for i in range(pairs)],
        "long_factor": [2.0 + 0.5 * i for i in range(pairs)],
        "original_max_position_embeddings": POSITION_THRESHOLD,
        **extra,
    }
    return {**kwargs, "rope_parameters": rope, "original_max_position_embeddings": POSITION_THRESHOLD}


@_override("phi3", "phi4_multimodal")
def _phi3(default, kwargs):
    return _longrope(default, kwargs)  # the 128k configs (Phi-3 / 3.5 / 4-mini)


@_override("phimoe")
def _phimoe(default, kwargs):
    return _longrope(default, kwargs, short_mscale=1.0, long_mscale=1.2)  # Phi-3.5-MoE


@_override("ministral3")
def _ministral3(default, kwargs):
    # Llama-4-style query scaling, 1 + beta * log(1 + floor(position / original_max_position_embeddings)).
    rope = {
        **kwargs.get("rope_parameters", default.rope_parameters),
        "original_max_position_embeddings": POSITION_THRESHOLD,
    }
    return {**kwargs, "rope_parameters": rope}


@_override("mamba2")
def _mamba2(default, kwargs):
    # hidden_size * expand must equal num_heads * head_dim.
    return {**kwargs, "head_dim": WIDTH * default.expand // kwargs.get("num_heads", default.num_heads)}


@_override("mellum")
def _mellum(default, kwargs):
    return _layout(kwargs, layer_types=["sliding_attention", "full_attention"])  # default: full only


@_override("minimax_m3_vl_text")
def _minimax_m3_vl_text(default, kwargs):
    # A block-sparse indexed layer (blocks of 4 keys, top 2 blocks) and a dense MLP layer.
    kwargs = _layout(
        kwargs, layer_types=["minimax_m3_sparse", "full_attention"], mlp_layer_types=["dense", "sparse"]
    )
    return {**kwargs, "index_block_size": 4, "index_topk_blocks": 2}


@_override("modernbert-decoder")
def _modernbert_decoder(default, kwargs):
    return {**kwargs, "local_attention": 2 * WINDOW}  # the sliding window is half of it


@_override("qwen4_exp_text")
def _qwen4_exp_text(default, kwargs):
    # The default's indexed-attention layers have no indexer configured. QSA indexer over blocks
    # of 4 keys with a budget of 8 tokens, per-layer n-gram embeddings (PLE) on a linear layer,
    # two hyper-connection streams.
    return {
        **kwargs,
        "indexer_n_heads": 2,
        "indexer_kv_heads": 1,
        "indexer_head_dim": HEAD_DIM,
        "indexer_budget": 8,
        "indexer_compress_ratio": 4,
        "ple_layer_ids": [1 + kwargs["layer_types"].index("linear_attention")],
        "ple_embed_dim": 32,
        "heads_per_ngram": 2,
        "ngram_vocab_size_base": 64,
        "split_ngram_parts": 1,
        "hc_count": 2,
        "hc_lowrank": 16,
        "eos_token_id": 2,
    }


@_override("recurrent_gemma")
def _recurrent_gemma(default, kwargs):
    # The block pattern is recurrent, recurrent, attention.
    return {**kwargs, "num_hidden_layers": max(3, kwargs.get("num_hidden_layers", 0))}


@_override("reformer")
def _reformer(default, kwargs):
    # ReformerModelWithLMHead needs is_decoder. In training mode Reformer requires the sequence
    # length to be a multiple of the chunk lengths (beyond one chunk) and, with axial position
    # embeddings, exactly their shape's product: so chunks of 64 and plain position embeddings.
    return {
        **_layout(kwargs, attn_layers=["local", "lsh"]),
        "is_decoder": True,
        "axial_pos_embds": False,
        "local_attn_chunk_length": 64,
        "lsh_attn_chunk_length": 64,
        "num_buckets": 4,
    }


@_override("roc_bert")
def _roc_bert(default, kwargs):
    return {
        **kwargs,
        "shape_vocab_size": VOCAB,
        "shape_embed_dim": 16,
        "pronunciation_vocab_size": VOCAB,
        "pronunciation_embed_dim": 16,
    }


@_override("smollm3")
def _smollm3(default, kwargs):
    return _without(kwargs, "layer_types")  # derived again: sliding windows on the NoPE layers


@_override("xmod")
def _xmod(default, kwargs):
    return {**kwargs, "default_language": default.languages[0]}


@_override("zamba")
def _zamba(default, kwargs):
    # The hybrid layers share one transformer block: two of them, so the sharing is exercised.
    return _layout(kwargs, layers_block_type=["linear_attention", "hybrid", "hybrid"])


@_override("zaya")
def _zaya(default, kwargs):
    return _layout(kwargs, layer_types=["hybrid_sliding", "hybrid"])  # default: full only


# --------------------------------------------------------------------------- building


def _sub_config_keys(config) -> list[str]:
    subs = getattr(config, "sub_configs", None) or {}
    return [key for key in subs if getattr(config, key, None) is not None]


def _tiny_level(config, names: list[str], layers: int) -> dict[str, Any]:
    """Shrink one level, then apply the override registered under the last of ``names`` that has one."""
    kwargs = shrink_kwargs(config, layers=layers)
    for name in reversed(names):
        if name in OVERRIDES:
            return OVERRIDES[name](config, kwargs)
    return kwargs


def _rebuild(config, kwargs: dict[str, Any]):
    """The same config class rebuilt with ``kwargs`` (so derived fields are derived again).

    A sub-config keeps the values its composite's defaults gave it where they differ from its
    own class's (a drafter's text config without per-layer inputs); fields that default to None
    are left out, as those are the ones ``__post_init__`` derives.
    """
    base: dict[str, Any] = {}
    if dataclasses.is_dataclass(config):
        read = getattr(
            config, "_getattr_without_heterogeneous_validation", functools.partial(getattr, config)
        )
        for field in dataclasses.fields(config):
            if not field.init or field.default is dataclasses.MISSING or field.default is None:
                continue
            value = read(field.name, None)
            if value != field.default and not isinstance(value, dict | list):
                base[field.name] = value
    return type(config)(**{**base, **kwargs})


class ArchitectureNotInstalled(KeyError):
    """``model_type`` is not in the installed transformers' causal-LM registry (an older version, or
    not a causal LM). A KeyError, as the registry lookup it replaces raised."""

    def __str__(self) -> str:
        return str(self.args[0])


def require_installed(model_type: str) -> None:
    """Raise :class:`ArchitectureNotInstalled`, naming the version, where transformers lacks ``model_type``."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ArchitectureNotInstalled(
            f"{model_type}: not a causal LM of the installed transformers {transformers.__version__}"
        )


def tiny_config(model_type: str, layers: int = 2):
    """A tiny ``PreTrainedConfig`` of ``model_type`` with its special features on (see module doc).

    Overrides apply by model type at every level; one registered as ``"<model_type>.<key>"``
    takes precedence for that sub-config (DBRX's ``attn_config`` has no model type of its own, a
    Gemma 4 drafter's text config is not shaped like Gemma 4's own).
    """
    from transformers import AutoConfig

    require_installed(model_type)
    return AutoConfig.for_model(model_type, **_tiny_kwargs(_default_config(model_type), model_type, layers))


def _tiny_kwargs(config, model_type: str, layers: int) -> dict[str, Any]:
    """The keyword arguments of a tiny ``config``: every level shrunk, sub-configs rebuilt."""
    kwargs = _tiny_level(config, [model_type], layers)
    if "is_decoder" in config.to_dict() and not config.is_decoder:
        # An encoder family's *ForCausalLM is a causal LM only as a decoder (transformers warns
        # otherwise and attends both ways): build it the way it is trained.
        kwargs["is_decoder"] = True
    for key in _sub_config_keys(config):
        sub = getattr(config, key)
        names = [getattr(sub, "model_type", None) or "", f"{model_type}.{key}"]
        kwargs[key] = _rebuild(sub, _tiny_level(sub, names, layers))
    return kwargs


def shrink_config(config, layers: int = 2):
    """A tiny copy of a real model's ``config`` (e.g. read from its config.json): its family and the
    values it sets, shrunk and with its special features on as ``tiny_config`` does for a family's
    defaults (overrides by model type at every level included)."""
    return _rebuild(config, _tiny_kwargs(config, config.model_type, layers))


def _default_config(model_type: str):
    """The family's default config; ``_DEFAULT_KWARGS`` for the few whose bare defaults don't validate."""
    from transformers import AutoConfig

    return AutoConfig.for_model(model_type, **_DEFAULT_KWARGS.get(model_type, {}))


def causal_lm_class(model_type: str):
    """The class transformers' causal-LM registry names for ``model_type``."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    require_installed(model_type)
    return getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type])


def config_for_class(cls, config):
    """``config`` or the sub-config ``cls`` takes (a text config for a text-only CausalLM class)."""
    wanted = getattr(cls, "config_class", None)
    if wanted is None or isinstance(config, wanted):
        return config
    for key in _sub_config_keys(config):
        sub = getattr(config, key)
        if isinstance(sub, wanted):
            return sub
    return config


def _perturb_zero_features(model: torch.nn.Module, generator: torch.Generator) -> None:
    """Give feature parameters that initialise to zero (attention sinks) random values.

    With zero sinks a bug that drops them would still show, but a bug that mixes them up
    between heads would not; random values make every head's sink distinct.
    """
    with torch.no_grad():
        for name, param in model.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            if leaf in ("sinks", "sink", "attention_sinks") and param.abs().max() == 0:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.5)


def tiny_model(model_type: str, seed: int = 0, attn_implementation: str = "eager", layers: int = 2):
    """A tiny randomly initialised model of the registry's causal-LM class for ``model_type`` (fp32)."""
    return random_model(tiny_config(model_type, layers=layers), seed, attn_implementation, model_type)


def random_model(config, seed: int = 0, attn_implementation: str = "eager", model_type: str | None = None):
    """A randomly initialised model of the registry's causal-LM class for ``config`` (fp32), with
    zero-initialised features (attention sinks) given values; ``config`` is best a tiny one."""
    cls = causal_lm_class(model_type or config.model_type)
    config = config_for_class(cls, config)
    torch.manual_seed(seed)
    model = cls._from_config(config, attn_implementation=attn_implementation, dtype=torch.float32)
    _perturb_zero_features(model, torch.Generator().manual_seed(seed + 1))
    with contextlib.suppress(AttributeError):
        model.config.use_cache = False
    return model


def parameter_count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


__all__ = [
    "OVERRIDES",
    "ArchitectureNotInstalled",
    "causal_lm_class",
    "config_for_class",
    "parameter_count",
    "random_model",
    "require_installed",
    "shrink_config",
    "shrink_kwargs",
    "tiny_config",
    "tiny_model",
]
