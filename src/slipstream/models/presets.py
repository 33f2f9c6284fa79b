"""Model shapes: tiny test configs and presets of real models, always randomly initialised.

Nothing is downloaded: a preset is a transformers config with a real model's shape, built
with random weights, so a benchmark on any machine needs no hub access. ``layers`` shortens
a preset (a GPU check can time 4 of Qwen3-8B's 36 layers).
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import (
    GptOssConfig,
    LlamaConfig,
    PreTrainedConfig,
    Qwen3Config,
    Qwen3MoeConfig,
)

from .heads import build_with_head

# Tiny shapes for tests and the demo: every family feature on (GQA, sliding windows, sinks, MoE).
# Each starts from one small shape and states only what differs from it.
_TINY_SHAPE: dict[str, Any] = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
)
TINY: dict[str, dict[str, Any]] = {
    "llama": dict(_TINY_SHAPE, family=LlamaConfig),
    "qwen3": dict(_TINY_SHAPE, family=Qwen3Config),
    "qwen3-sliding": dict(
        _TINY_SHAPE,
        family=Qwen3Config,
        use_sliding_window=True,
        sliding_window=8,
        layer_types=["sliding_attention", "full_attention"],
    ),
    "qwen3-moe": dict(
        _TINY_SHAPE,
        family=Qwen3MoeConfig,
        moe_intermediate_size=32,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
    ),
    "gpt-oss": dict(
        _TINY_SHAPE,
        family=GptOssConfig,
        intermediate_size=64,
        num_local_experts=8,
        num_experts_per_tok=2,
        sliding_window=8,
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    ),
    # The demo's model: big enough to learn the built-in tasks, small enough for 2 CPU cores.
    "demo": dict(
        _TINY_SHAPE,
        family=Qwen3Config,
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=4,
        head_dim=32,
    ),
}

# Real shapes (see ../shared/CONTEXT.md), checked against the transformers config classes. Each
# family's preset states only what differs from its family's shared fields.
_QWEN3: dict[str, Any] = dict(family=Qwen3Config, num_key_value_heads=8, head_dim=128, vocab_size=151936)
_QWEN3_MOE: dict[str, Any] = dict(
    _QWEN3, family=Qwen3MoeConfig, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True
)
_GPT_OSS: dict[str, Any] = dict(
    family=GptOssConfig,
    num_key_value_heads=8,
    head_dim=64,
    num_local_experts=32,
    num_experts_per_tok=4,
    sliding_window=128,
    vocab_size=201088,
)
PRESETS: dict[str, dict[str, Any]] = {
    "llama-3.2-1b": dict(
        family=LlamaConfig,
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        vocab_size=128256,
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
    ),
    "qwen3-0.6b": dict(
        _QWEN3,
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=28,
        num_attention_heads=16,
        tie_word_embeddings=True,
    ),
    "qwen3-8b": dict(
        _QWEN3, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32
    ),
    "qwen3-14b": dict(
        _QWEN3, hidden_size=5120, intermediate_size=17408, num_hidden_layers=40, num_attention_heads=40
    ),
    "qwen3-30b-a3b": dict(
        _QWEN3_MOE,
        hidden_size=2048,
        intermediate_size=6144,
        moe_intermediate_size=768,
        num_hidden_layers=48,
        num_attention_heads=32,
        num_key_value_heads=4,
    ),
    "gpt-oss-20b": dict(
        _GPT_OSS, hidden_size=2880, intermediate_size=2880, num_hidden_layers=24, num_attention_heads=64
    ),
    # The MoE benchmark's CPU-sized shapes: the real routing (128 experts top-8; 32 experts
    # top-4) and expert width ratios at hidden 256.
    "qwen3-moe-bench-cpu": dict(
        _QWEN3_MOE,
        hidden_size=256,
        intermediate_size=768,
        moe_intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    ),
    "gpt-oss-bench-cpu": dict(
        _GPT_OSS,
        hidden_size=256,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters={"rope_type": "default", "rope_theta": 150000.0},
    ),
    # The packing benchmark's CPU-sized Qwen3: Qwen3-0.6B's proportions at a quarter of its
    # width (hidden 256, intermediate 3x hidden, 2:1 GQA, head_dim 128 as in every Qwen3) and
    # Qwen3's real vocabulary.
    "qwen3-bench-cpu": dict(
        _QWEN3,
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
    ),
}


def preset_vocab_size(name: str) -> int | None:
    """The real vocabulary of a real-model preset; None for the tiny shapes (they take the tokenizer's)."""
    return PRESETS.get(name, {}).get("vocab_size")


def model_names() -> list[str]:
    return sorted([*TINY, *PRESETS])


def build_config(
    name: str, vocab_size: int | None = None, layers: int | None = None, **overrides
) -> PreTrainedConfig:
    """A config with the shape called ``name`` (see ``model_names()``).

    ``vocab_size`` overrides the preset's (tiny models take the tokenizer's; benchmarks never
    shrink a preset's, see ``preset_vocab_size``); ``layers``
    shortens the stack (``layer_types`` is cut to match).
    """
    table = TINY if name in TINY else PRESETS if name in PRESETS else None
    if table is None:
        raise KeyError(f"unknown model shape {name!r}; choose one of {', '.join(model_names())}")
    spec = dict(table[name])
    family = spec.pop("family")
    spec.setdefault("vocab_size", 512)
    if vocab_size is not None:
        spec["vocab_size"] = vocab_size
    if layers is not None:
        spec["num_hidden_layers"] = layers
        if "layer_types" in spec:
            base = spec["layer_types"]
            spec["layer_types"] = [base[i % len(base)] for i in range(layers)]
    spec.update(overrides)
    spec.setdefault("use_cache", False)
    return family(**spec)


def build_model(
    name: str,
    vocab_size: int | None = None,
    layers: int | None = None,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    attn_implementation: str = "sdpa",
    head: str = "causal-lm",
    **overrides,
) -> torch.nn.Module:
    """A randomly initialised model with the shape called ``name``: a causal LM, or with ``head="reward"``
    a one-label sequence classifier (:mod:`.heads`); the same seed gives the same weights."""
    config = build_config(name, vocab_size=vocab_size, layers=layers, **overrides)
    if isinstance(config, GptOssConfig) and attn_implementation == "sdpa":
        attn_implementation = "eager"  # GPT-OSS refuses sdpa (sinks)
    torch.manual_seed(seed)
    model = build_with_head(config, head, attn_implementation=attn_implementation, dtype=dtype)
    if isinstance(config, GptOssConfig):
        # Sinks start at zero in some versions; give them a value so tests exercise them.
        with torch.no_grad():
            for module in model.modules():
                if hasattr(module, "sinks"):
                    module.sinks.normal_(0.0, 1.0)
    return model
