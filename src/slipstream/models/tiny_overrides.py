"""Per-family overrides of the tiny configs :mod:`slipstream.models.tiny_any` builds: what a family
needs on top of the generic shrinker (a layer pattern that holds every kind of layer it mixes, a
feature its defaults leave off, a size the shrinker can't derive), one function per family, or
one ``_fixed`` / ``_pattern`` line where it only sets values or a layer pattern.

A table, kept apart from the building logic it plugs into: a new family's entry goes here.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from collections.abc import Callable
from typing import Any

from .tiny_sizes import (
    DYNAMIC_ROPE_POSITIONS,
    EXPERT_FFN,
    EXPERTS,
    FFN,
    HEAD_DIM,
    HEADS,
    KV_HEADS,
    POSITION_THRESHOLD,
    TOP_K,
    VOCAB,
    WIDTH,
    WINDOW,
)

# model_type -> a function (default config, kwargs from the generic shrinker) -> kwargs to use.
Override = Callable[[Any, dict[str, Any]], dict[str, Any]]
OVERRIDES: dict[str, Override] = {}


def _override(*model_types: str) -> Callable[[Override], Override]:
    def register(fn: Override) -> Override:
        for model_type in model_types:
            OVERRIDES[model_type] = fn
        return fn

    return register


def _fixed(*model_types: str, **values: Any) -> None:
    """An override that sets ``values`` (a fresh copy each time) on top of the shrunk kwargs."""
    _override(*model_types)(lambda default, kwargs: {**kwargs, **copy.deepcopy(values)})


def _pattern(*model_types: str, **pattern: list) -> None:
    """An override that lays ``pattern`` over the layers (:func:`_layout`)."""
    _override(*model_types)(lambda default, kwargs: _layout(kwargs, **pattern))


# Default-config keyword arguments for families whose bare defaults don't validate.
DEFAULT_KWARGS: dict[str, dict[str, Any]] = {
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


_fixed("bamba", attn_layer_indices=[1])  # the default is Mamba layers only
# The hash n-gram embeddings are 6 tables of 500k rows by default.
_fixed("blt", encoder_hash_byte_group_vocab=64, encoder_hash_byte_group_size=[3, 4])


@_override("cohere_compass_text")
def _cohere_compass(default, kwargs):
    # The default has full-attention layers only and no RoPE parameters for them; North has
    # sliding layers with (M-)RoPE and NoPE full-attention layers.
    section = [HEAD_DIM // 4, HEAD_DIM // 8, HEAD_DIM // 8]  # sums to HEAD_DIM / 2
    rope = {"rope_type": "default", "rope_theta": 10_000.0, "mrope_section": section}
    kwargs = _layout(kwargs, layer_types=["sliding_attention", "full_attention"])
    return {**kwargs, "rope_parameters": {"sliding_attention": rope, "full_attention": None}}


# The input embedding has ``prompt_types * prompt_length`` prompt rows past the vocabulary;
# kept within the reserved top ids so document ids stay inside the output vocabulary.
_fixed("cpmant", prompt_types=3, prompt_length=4)
# DbrxAttention reads ``rope_theta`` off its attention config (released configs carry it).
_fixed("dbrx.attn_config", kv_n_heads=KV_HEADS, clip_qkv=8.0, rope_theta=500_000.0)
_fixed("dbrx.ffn_config", ffn_hidden_size=EXPERT_FFN, moe_num_experts=EXPERTS, moe_top_k=TOP_K)
# Group-limited routing (DeepSeek-V2's released configs) rather than the greedy default.
_fixed("deepseek_v2", topk_method="group_limited_greedy", n_group=2, topk_group=1)


@_override("dory")
def _dory(default, kwargs):
    # Input, recurrent (looped) and output sections; the recurrent one is what is left over.
    kwargs = _layout(kwargs, layer_types=["sliding_attention", "full_attention", "sliding_attention"])
    return {**_without(kwargs, "n_recurrent_layers"), "n_input_layers": 1, "n_output_layers": 1}


# The default leaves the MoE unset (a dense model); dots.llm1 routes 6 of 128 with 2 shared.
_fixed(
    "dots1", n_routed_experts=EXPERTS, n_shared_experts=1, num_experts_per_tok=TOP_K, first_k_dense_replace=1
)


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
    if any(field.name == "enable_moe_block" and field.init for field in dataclasses.fields(default)):
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


# GitForCausalLM drops ``image_patch_tokens`` logits before the loss whether or not an image
# was given; with no image embeddings that count is 0 and a text-only loss lines up.
_fixed("git", num_image_with_embedding=0)


@_override("gpt_neo")
def _gpt_neo(default, kwargs):
    pairs = -(-kwargs["num_layers"] // 2)
    return {
        **kwargs,
        "num_layers": 2 * pairs,
        "attention_types": [[["global", "local"], pairs]],
        "window_size": WINDOW,
    }


_pattern("granitemoehybrid", layer_types=["linear_attention", "full_attention"])  # default: Mamba only
# Dynamic NTK RoPE (the rope type Hunyuan's configs name; without ``alpha``, which would make it
# static): its frequencies grow past max_position_embeddings, set here above every test
# document and below a packed row, so only a model that took the row's length for a
# document's would grow them.
_fixed(
    "hunyuan_v1_dense",
    rope_parameters={"rope_type": "dynamic", "rope_theta": 10_000.0, "factor": 2.0},
    max_position_embeddings=DYNAMIC_ROPE_POSITIONS,
)
_fixed("hunyuan_v1_moe", num_experts=EXPERTS, moe_topk=TOP_K)  # the default is a single expert
# Block attention residuals: a block boundary and a layer inside the block. A relative
# position extent shorter than a document, so the bias's cut-off is exercised.
_fixed("inkling2_text", "inkling2_loop_text", n_layers_per_attn_res_block=2, rel_extent=2 * WINDOW)
_fixed("jamba", attn_layer_period=2, attn_layer_offset=1)  # Mamba, attention, ...


@_override("laguna")
def _laguna(default, kwargs):
    kwargs = _layout(kwargs, layer_types=["sliding_attention", "full_attention"])
    return {**kwargs, "num_attention_heads_per_layer": [HEADS] * kwargs["num_hidden_layers"]}


# Short-convolution and attention layers (LFM2's default is attention only, LFM2-MoE's unset).
_pattern("lfm2", "lfm2_moe", layer_types=["conv", "full_attention"])


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


_override("phi3", "phi4_multimodal")(_longrope)  # the 128k configs (Phi-3 / 3.5 / 4-mini)
_override("phimoe")(functools.partial(_longrope, short_mscale=1.0, long_mscale=1.2))  # Phi-3.5-MoE


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


_pattern("mellum", layer_types=["sliding_attention", "full_attention"])  # default: full only


@_override("minimax_m3_vl_text")
def _minimax_m3_vl_text(default, kwargs):
    # A block-sparse indexed layer (blocks of 4 keys, top 2 blocks) and a dense MLP layer.
    kwargs = _layout(
        kwargs, layer_types=["minimax_m3_sparse", "full_attention"], mlp_layer_types=["dense", "sparse"]
    )
    return {**kwargs, "index_block_size": 4, "index_topk_blocks": 2}


_fixed("modernbert-decoder", local_attention=2 * WINDOW)  # the sliding window is half of it


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


_fixed(
    "roc_bert",
    shape_vocab_size=VOCAB,
    shape_embed_dim=16,
    pronunciation_vocab_size=VOCAB,
    pronunciation_embed_dim=16,
)


@_override("smollm3")
def _smollm3(default, kwargs):
    return _without(kwargs, "layer_types")  # derived again: sliding windows on the NoPE layers


@_override("xmod")
def _xmod(default, kwargs):
    return {**kwargs, "default_language": default.languages[0]}


# The hybrid layers share one transformer block: two of them, so the sharing is exercised.
_pattern("zamba", layers_block_type=["linear_attention", "hybrid", "hybrid"])
_pattern("zaya", layer_types=["hybrid_sliding", "hybrid"])  # default: full only
