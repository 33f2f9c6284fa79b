"""Gemma 2 / Gemma 3 text in the GGUF export: the keys llama.cpp's ``gemma2`` / ``gemma3`` read beyond the
common ones (soft-caps, the sliding window per layer, the sliding layers' RoPE base, a linear RoPE factor
on the global layers), read from the config transformers runs, and every setting llama.cpp would run
differently refused by name."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .merged import ExportError

GEMMA_TYPES = ("gemma2", "gemma3_text")
# llama.cpp scales Gemma's queries by 1 / sqrt(head size), except for the layer count it takes for the 27B
# model, where it uses 1 / sqrt(width / heads) (llama_model_gemma2 / gemma3::load_arch_hparams)
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3_text": 62}


def llama_cpp_query_scalar(model_type: str, layers: int, width: int, heads: int, head_dim: int) -> int:
    """The ``query_pre_attn_scalar`` llama.cpp's Gemma graph assumes for this shape."""
    return width // heads if layers == _GEMMA_27B_LAYERS[model_type] else head_dim


@dataclass(frozen=True)
class GemmaKeys:
    """What llama.cpp's gemma2 / gemma3 read beyond the common keys, from the config transformers runs."""

    rope_theta: float  # the global (full-attention) layers' base
    rope_theta_swa: float  # the sliding layers' base (gemma3: rope_local_base_freq)
    rope_linear: float | None  # a linear RoPE factor on the global layers
    window: int | None
    swa_layers: list[bool]  # which layers slide, written per layer
    attn_softcap: float | None
    final_softcap: float | None


def _rope_of(rope: dict, layer_type: str) -> dict:
    """transformers' RoPE parameters for one layer type (Gemma 3 keys them by type; Gemma 2 has one set)."""
    return rope[layer_type] if isinstance(rope.get(layer_type), dict) else rope


def gemma_keys(model_dir: Path, model_type: str) -> GemmaKeys:
    """Gemma 2 / Gemma 3 text as llama.cpp's ``gemma2`` / ``gemma3`` run them, from the config transformers
    builds (an older config.json's rope_scaling, rope_local_base_freq or sliding_window_pattern normalised
    as transformers does); whatever llama.cpp would run differently is refused by name."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(model_dir)
    except (OSError, ValueError) as error:
        raise ExportError(f"{model_dir / 'config.json'}: transformers cannot read it ({error})") from None
    where = f"{model_dir}: {model_type}"
    activation = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", None)
    if activation != "gelu_pytorch_tanh":
        raise ExportError(
            f"{where} hidden_activation {activation!r}: llama.cpp's Gemma graph uses GELU's tanh approximation "
            "(gelu_pytorch_tanh) only"
        )
    if getattr(config, "attention_bias", False):
        raise ExportError(f"{where} attention_bias: llama.cpp's Gemma graph has no attention biases")
    if getattr(config, "use_bidirectional_attention", False):
        raise ExportError(
            f"{where} use_bidirectional_attention: llama.cpp's {model_type} attention is causal"
        )
    if model_type == "gemma2" and not config.tie_word_embeddings:
        raise ExportError(
            f"{where} with an untied LM head: llama.cpp's gemma2 reads the head from the embedding"
        )
    layers, width, heads = config.num_hidden_layers, config.hidden_size, config.num_attention_heads
    head_dim = config.head_dim or width // heads
    assumed = llama_cpp_query_scalar(model_type, layers, width, heads, head_dim)
    if float(config.query_pre_attn_scalar) != float(assumed):
        raise ExportError(
            f"{where} query_pre_attn_scalar {config.query_pre_attn_scalar}: llama.cpp scales queries by "
            f"1/sqrt({assumed}) for this shape ({layers} layers, head size {head_dim}), so it would run another model"
        )
    attn_cap, final_cap = config.attn_logit_softcapping, config.final_logit_softcapping
    if model_type == "gemma2" and (attn_cap is None or final_cap is None):
        raise ExportError(
            f"{where} without attn_logit_softcapping / final_logit_softcapping: llama.cpp's gemma2 always "
            "soft-caps both (50 / 30 where the file has no value)"
        )
    if model_type == "gemma3_text" and attn_cap is not None:
        raise ExportError(
            f"{where} attn_logit_softcapping {attn_cap}: llama.cpp's gemma3 has no attention soft-capping"
        )
    types = list(config.layer_types or [])
    odd = sorted(set(types) - {"sliding_attention", "full_attention"})
    if len(types) != layers or odd:
        raise ExportError(
            f"{where} layer_types {odd or types}: llama.cpp's {model_type} has sliding and full layers only"
        )
    swa = [kind == "sliding_attention" for kind in types]
    window = config.sliding_window
    if any(swa) and not window:
        raise ExportError(f"{where}: sliding layers without a sliding_window")
    rope = config.rope_parameters or {}
    full, sliding = _rope_of(rope, "full_attention"), _rope_of(rope, "sliding_attention")
    full_type = full.get("rope_type", full.get("type")) or "default"
    if full_type not in ("default", "linear"):
        raise ExportError(
            f"{where} RoPE scaling {full_type!r}: the GGUF export writes linear RoPE scaling only"
        )
    sliding_type = sliding.get("rope_type", sliding.get("type")) or "default"
    if any(swa) and sliding is not full and sliding_type != "default":
        raise ExportError(
            f"{where} RoPE scaling {sliding_type!r} on the sliding layers: llama.cpp's gemma3 scales the global "
            "layers' RoPE only"
        )
    if (full.get("partial_rotary_factor") or 1.0) != 1.0:
        raise ExportError(f"{where} partial_rotary_factor: llama.cpp's Gemma graph rotates the whole head")
    theta = float(full.get("rope_theta") or 10000.0)
    return GemmaKeys(
        rope_theta=theta,
        rope_theta_swa=float(sliding.get("rope_theta") or theta),
        rope_linear=float(full["factor"]) if full_type == "linear" else None,
        window=int(window) if window else None,
        swa_layers=swa,
        attn_softcap=float(attn_cap) if attn_cap is not None else None,
        final_softcap=float(final_cap) if final_cap else None,
    )


def _add_gemma_keys(writer, keys: GemmaKeys) -> None:
    """llama.cpp's gemma2 / gemma3 keys: soft-caps, the window, which layers slide, the sliding layers'
    RoPE base and the global layers' linear RoPE factor."""
    from gguf import RopeScalingType

    if keys.attn_softcap is not None:
        writer.add_attn_logit_softcapping(keys.attn_softcap)
    if keys.final_softcap is not None:
        writer.add_final_logit_softcapping(keys.final_softcap)
    if keys.window is not None:
        writer.add_sliding_window(keys.window)
    writer.add_sliding_window_pattern(keys.swa_layers)  # per layer: read before llama.cpp's default period
    writer.add_rope_freq_base_swa(keys.rope_theta_swa)
    if keys.rope_linear is not None:
        writer.add_rope_scaling_type(RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(keys.rope_linear)
