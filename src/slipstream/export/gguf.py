"""``slipstream export SOURCE --gguf OUT.gguf``: a merged model written as GGUF, the file llama.cpp, Ollama and
LM Studio read.

What is written (llama.cpp's layout, read with the ``gguf`` package's writer and its tensor-name maps):

- **the architecture's metadata**: context, widths, heads (and the head size where it is not width / heads),
  RoPE base, the RMSNorm epsilon, the vocabulary size; for Gemma (:func:`gemma_keys`) the soft-caps, the
  sliding window and which layers slide (written per layer), the sliding layers' RoPE base and a linear
  RoPE factor on the global layers;
- **the tokenizer**: every token by id (``tokenizer.json``'s vocabulary and its added tokens), their types
  (an added special token is CONTROL, an added plain one USER_DEFINED), the BPE merges, the special ids, and
  the pre-tokenizer llama.cpp must split text with (named from ``tokenizer.json``'s own pre-tokenizer: a
  tokenizer whose splitting llama.cpp does not reproduce is refused, since llama.cpp would tokenize text
  differently from the run); the chat template the run trained with;
- **the tensors**: renamed by ``gguf.tensor_mapping``; for the ``llama`` architecture the query and key
  projections reordered within each head, because llama.cpp rotates interleaved pairs where transformers
  rotates the two halves of a head (``_interleave_halves``); an embedding tied to the head written once;
  Gemma's norms written as 1 + weight (transformers' Gemma RMSNorm multiplies by 1 + weight, llama.cpp's by
  the weight it reads; its graph scales the embedding by sqrt(width) itself, and rotates halves as
  transformers does).

Types: ``f32``, ``f16``, ``bf16`` and the block types the ``gguf`` package quantizes in Python (``q8_0``,
``q5_1``, ``q5_0``, ``q4_1``, ``q4_0``); norms and biases stay f32, as llama.cpp's converter keeps them, and
under a block type the LM head stays f16 (``_head_copies``). The
k-quants (``q4_k_m`` ...) need llama.cpp's own quantizer and are refused with the command that makes them.

Families: Llama (SmolLM2 included), Mistral without a sliding window shorter than its context (llama.cpp's
``llama`` architecture has none), Qwen2 / Qwen2.5 and Qwen3, Gemma 2 and Gemma 3 text (llama.cpp's ``gemma2``
/ ``gemma3``), with byte-level BPE tokenizers. Anything else (another family, a SentencePiece tokenizer, RoPE
scaling other than Gemma's linear factor on its global layers, a Gemma that llama.cpp would run differently:
a ``query_pre_attn_scalar`` other than the one llama.cpp assumes, Gemma 2 without soft-caps, Gemma 3 with an
attention soft-cap, ...) is refused by name before anything is written.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .merged import ExportError

# the block types the gguf package quantizes in Python, and the plain ones
PYTHON_TYPES = ("f32", "f16", "bf16", "q8_0", "q5_1", "q5_0", "q4_1", "q4_0")
# llama.cpp's own quantizer only (llama-quantize): refused, naming it
LLAMA_CPP_TYPES = (
    "q2_k", "q3_k_s", "q3_k_m", "q3_k_l", "q4_k_s", "q4_k_m", "q5_k_s", "q5_k_m", "q6_k",
    "iq1_s", "iq1_m", "iq2_xxs", "iq2_xs", "iq2_s", "iq2_m", "iq3_xxs", "iq3_s", "iq3_m", "iq4_nl", "iq4_xs",
)  # fmt: skip


@dataclass(frozen=True)
class Family:
    arch: str  # gguf.MODEL_ARCH's name
    interleave_qk: bool  # llama.cpp's llama architecture rotates interleaved pairs: reorder q / k
    # Gemma's RMSNorm multiplies by (1 + weight), llama.cpp's by the stored weight: 1 added to every norm
    norm_shift: float = 0.0
    # llama.cpp's gemma2 reads the head from token_embd only (an output.weight is an unexpected tensor)
    head_is_embedding: bool = False


FAMILIES = {
    "llama": Family("LLAMA", True),
    "mistral": Family("LLAMA", True),
    "qwen2": Family("QWEN2", False),
    "qwen3": Family("QWEN3", False),
    "gemma2": Family("GEMMA2", False, norm_shift=1.0, head_is_embedding=True),
    "gemma3_text": Family("GEMMA3", False, norm_shift=1.0),
}

# tokenizer.json's pre-tokenizer -> llama.cpp's name for the same splitting (tokenizer.ggml.pre)
_GPT2 = {"type": "ByteLevel", "use_regex": True}
_QWEN2_REGEX = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_LLAMA3_REGEX = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"


def _matches(found: dict, wanted: dict) -> bool:
    return all(found.get(key) == value for key, value in wanted.items())


def pre_tokenizer_name(tokenizer_json: dict) -> str | None:
    """llama.cpp's pre-tokenizer that splits text as ``tokenizer_json``'s does (None: none it has)."""
    pre = tokenizer_json.get("pre_tokenizer") or {}
    parts = pre.get("pretokenizers") if pre.get("type") == "Sequence" else [pre]
    parts = [p for p in parts or [] if p]
    if len(parts) == 1 and _matches(parts[0], _GPT2):
        return "gpt-2"
    if len(parts) == 2 and parts[0].get("type") == "Digits" and parts[0].get("individual_digits"):
        return "smollm" if _matches(parts[1], _GPT2) else None
    if (
        len(parts) == 2
        and parts[0].get("type") == "Split"
        and _matches(parts[1], {"type": "ByteLevel", "use_regex": False})
    ):
        regex = (parts[0].get("pattern") or {}).get("Regex")
        return {_QWEN2_REGEX: "qwen2", _LLAMA3_REGEX: "llama-bpe"}.get(regex)
    return None


@dataclass
class GGUFPlan:
    """What will be written, decided and checked before anything is: the family, the type, the tokenizer."""

    family: Family
    model_type: str
    quant: str
    config: dict
    tokenizer: dict
    pre: str


def plan_gguf(model_dir: Path, quant: str) -> GGUFPlan:
    """Read ``model_dir`` (a merged transformers directory) and refuse, one line naming it, what cannot be
    written exactly: another family, a type llama.cpp quantizes itself, another tokenizer, RoPE scaling."""
    quant = quant.lower()
    if quant in LLAMA_CPP_TYPES:
        raise ExportError(
            f"--quant {quant}: llama.cpp's own quantizer makes it (the gguf package quantizes only "
            f"{', '.join(PYTHON_TYPES)}): export --quant f16 (or bf16), then llama-quantize OUT.gguf "
            f"OUT-{quant}.gguf {quant.upper()}"
        )
    if quant not in PYTHON_TYPES:
        raise ExportError(
            f"--quant {quant}: not a GGUF type the export writes (choose {', '.join(PYTHON_TYPES)})"
        )
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError) as error:
        raise ExportError(f"{model_dir / 'config.json'}: cannot read it ({error})") from None
    model_type = config.get("model_type")
    family = FAMILIES.get(model_type)
    if family is None:
        raise ExportError(
            f"{model_dir}: model_type {model_type!r} is not a family the GGUF export writes "
            f"({', '.join(sorted(FAMILIES))}; see docs/export.md)"
        )
    if model_type in GEMMA_TYPES:
        gemma_keys(model_dir, model_type)  # its refusals, RoPE scaling's included
    # transformers 5 saves RoPE scaling as rope_parameters (older config.json files: rope_scaling)
    rope = (
        {} if model_type in GEMMA_TYPES else config.get("rope_scaling") or config.get("rope_parameters") or {}
    )
    kind = rope.get("rope_type", rope.get("type")) if isinstance(rope, dict) else None
    if kind not in (None, "default"):
        raise ExportError(f"{model_dir}: RoPE scaling {kind!r} is not exported to GGUF yet")
    window = config.get("sliding_window") if config.get("use_sliding_window", True) else None
    if model_type == "mistral" and window is not None and window < config.get("max_position_embeddings", 0):
        raise ExportError(
            f"{model_dir}: sliding_window {window} is shorter than the context "
            f"({config.get('max_position_embeddings')}): llama.cpp's llama architecture has no sliding window"
        )
    try:
        tokenizer = json.loads((model_dir / "tokenizer.json").read_text())
    except (OSError, ValueError) as error:
        raise ExportError(f"{model_dir / 'tokenizer.json'}: cannot read it ({error})") from None
    model = tokenizer.get("model") or {}
    if (
        model.get("type") != "BPE"
        or model.get("byte_fallback")
        or (tokenizer.get("decoder") or {}).get("type") != "ByteLevel"
    ):
        raise ExportError(
            f"{model_dir / 'tokenizer.json'}: a {model.get('type')} tokenizer without byte-level BPE: the GGUF "
            "export writes byte-level BPE tokenizers only (SentencePiece ones are not exported yet)"
        )
    pre = pre_tokenizer_name(tokenizer)
    if pre is None:
        raise ExportError(
            f"{model_dir / 'tokenizer.json'}: its pre-tokenizer ({json.dumps(tokenizer.get('pre_tokenizer'))[:120]}) "
            "is not one llama.cpp reproduces, so llama.cpp would split text differently from the run"
        )
    return GGUFPlan(family, model_type, quant, config, tokenizer, pre)


def _interleave_halves(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows of each head reordered from (first half, second half) to interleaved pairs (0, d/2, 1, d/2+1, ...):
    transformers' RoPE rotates element i with element i + d/2 of a head, llama.cpp's ``llama`` architecture
    rotates element 2i with 2i + 1, so this order makes llama.cpp rotate the same pairs."""
    rows, cols = weight.shape
    size = rows // heads
    return weight.reshape(heads, 2, size // 2, cols).transpose(1, 2).reshape(rows, cols)


def _tokens(plan: GGUFPlan) -> tuple[list[str], list[int], list[str]]:
    """Every token by id, its llama.cpp type, and the merges as ``"left right"``."""
    from gguf import TokenType

    model = plan.tokenizer["model"]
    by_id: dict[int, str] = {int(i): text for text, i in model["vocab"].items()}
    kinds: dict[int, int] = {}
    for added in plan.tokenizer.get("added_tokens") or []:
        by_id[int(added["id"])] = added["content"]
        kinds[int(added["id"])] = TokenType.CONTROL if added.get("special") else TokenType.USER_DEFINED
    size = max(int(plan.config.get("vocab_size") or 0), max(by_id) + 1)
    tokens, types = [], []
    for i in range(size):
        if i in by_id:
            tokens.append(by_id[i])
            types.append(int(kinds.get(i, TokenType.NORMAL)))
        else:  # the embedding has rows past the tokenizer's ids: padding llama.cpp never produces
            tokens.append(f"[PAD{i}]")
            types.append(int(TokenType.UNUSED))
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges") or []]
    return tokens, types, merges


def _specials(tokenizer) -> dict[str, Any]:
    """Special ids and whether the tokenizer adds BOS / EOS, from the transformers tokenizer itself."""
    probe = tokenizer("a")["input_ids"]
    return {
        "bos": tokenizer.bos_token_id,
        "eos": tokenizer.eos_token_id,
        "unk": tokenizer.unk_token_id,
        "pad": tokenizer.pad_token_id,
        "add_bos": tokenizer.bos_token_id is not None and bool(probe) and probe[0] == tokenizer.bos_token_id,
        "add_eos": tokenizer.eos_token_id is not None and bool(probe) and probe[-1] == tokenizer.eos_token_id,
    }


def _as_numpy(tensor: torch.Tensor, quant: str) -> tuple[np.ndarray, Any]:
    """``tensor`` in the type it is written as: f32 for 1-D tensors (norms, biases) and rows a block type
    cannot hold; else ``quant``. Returns the array and its raw GGML type (None: numpy's own)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import quantize

    data = tensor.detach().to(torch.float32).cpu().numpy()
    if data.ndim == 1 or quant == "f32":
        return data, None
    if quant == "f16":
        return data.astype(np.float16), None
    qtype = GGMLQuantizationType[quant.upper()]
    block = GGML_QUANT_SIZES[qtype][0]
    if data.shape[-1] % block:  # a row the block type cannot hold: f16, as llama.cpp falls back
        return data.astype(np.float16), None
    return quantize(data, qtype), qtype


def _head_copies(name: str, tied: bool, quant: str) -> list[tuple[str, str]]:
    """The LM head in f16 under a block type: every logit, so every top-1, reads it (llama.cpp's own
    quantizer keeps the head finer than the rest too). A head tied to the embedding is written twice then:
    the embedding in the block type, ``output.weight`` in f16 (llama.cpp uses it where it is present)."""
    if quant in ("f32", "f16", "bf16"):
        return [(name, quant)]
    if tied:
        return [(name, quant), ("output.weight", "f16")]
    return [(name, "f16")]


GEMMA_TYPES = ("gemma2", "gemma3_text")
# llama.cpp scales Gemma's queries by 1 / sqrt(head size), except for the layer count it takes for the 27B
# model, where it uses 1 / sqrt(width / heads) (llama_model_gemma2 / gemma3::load_arch_hparams)
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3_text": 62}


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
    assumed = width // heads if layers == _GEMMA_27B_LAYERS[model_type] else head_dim
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


def write_gguf(model_dir: Path, out: Path, plan: GGUFPlan, chat_template: str | None) -> dict[str, Any]:
    """Write ``model_dir``'s weights and tokenizer to ``out`` as ``plan`` says; returns what was written."""
    import gguf
    from safetensors import safe_open
    from transformers import AutoTokenizer

    config, family = plan.config, plan.family
    arch = gguf.MODEL_ARCH[family.arch]
    layers = int(config["num_hidden_layers"])
    heads = int(config["num_attention_heads"])
    kv_heads = int(config.get("num_key_value_heads") or heads)
    width = int(config["hidden_size"])
    head_dim = int(config.get("head_dim") or width // heads)
    names = gguf.get_tensor_name_map(arch, layers)
    writer = gguf.GGUFWriter(str(out), gguf.MODEL_ARCH_NAMES[arch])
    writer.add_name(model_dir.name)
    writer.add_context_length(int(config.get("max_position_embeddings") or 2048))
    writer.add_embedding_length(width)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(int(config["intermediate_size"]))
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(head_dim)  # always: a reader's default head size need not be width / heads
    writer.add_value_length(head_dim)
    rope = config.get("rope_parameters") or {}
    theta = (
        config.get("rope_theta") or (rope.get("rope_theta") if isinstance(rope, dict) else None) or 10000.0
    )
    gemma = gemma_keys(model_dir, plan.model_type) if plan.model_type in GEMMA_TYPES else None
    if gemma is not None:
        theta = gemma.rope_theta
        _add_gemma_keys(writer, gemma)
    writer.add_rope_freq_base(float(theta))
    writer.add_rope_dimension_count(head_dim)
    writer.add_layer_norm_rms_eps(float(config.get("rms_norm_eps") or 1e-6))
    file_type = {
        "f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
        "bf16": gguf.LlamaFileType.MOSTLY_BF16, "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
        "q5_1": gguf.LlamaFileType.MOSTLY_Q5_1, "q5_0": gguf.LlamaFileType.MOSTLY_Q5_0,
        "q4_1": gguf.LlamaFileType.MOSTLY_Q4_1, "q4_0": gguf.LlamaFileType.MOSTLY_Q4_0,
    }[plan.quant]  # fmt: skip
    writer.add_file_type(int(file_type))
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)

    tokens, types, merges = _tokens(plan)
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(plan.pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    specials = _specials(AutoTokenizer.from_pretrained(model_dir))
    for key, add in (("bos", writer.add_bos_token_id), ("eos", writer.add_eos_token_id),
                     ("unk", writer.add_unk_token_id), ("pad", writer.add_pad_token_id)):  # fmt: skip
        if specials[key] is not None:
            add(int(specials[key]))
    writer.add_add_bos_token(bool(specials["add_bos"]))
    writer.add_add_eos_token(bool(specials["add_eos"]))
    if chat_template:
        writer.add_chat_template(chat_template)

    counts: dict[str, int] = {}
    # Gemma's configs tie the head unless they say otherwise (an older config.json may not say)
    tied = bool(config.get("tie_word_embeddings", plan.model_type in GEMMA_TYPES))
    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as weights:
            for key in weights.keys():  # noqa: SIM118 (safe_open has no __iter__)
                if tied and key == "lm_head.weight":
                    continue  # llama.cpp reads the tied head from the embedding
                name = names.get_name(key, try_suffixes=(".weight", ".bias"))
                if name is None:
                    raise ExportError(f"{path}: tensor {key} has no GGUF name for {plan.model_type}")
                tensor = weights.get_tensor(key)
                if family.norm_shift and key.endswith("norm.weight"):  # 1 + w in f32, as Gemma computes it
                    tensor = tensor.to(torch.float32) + family.norm_shift
                if family.interleave_qk and key.endswith("self_attn.q_proj.weight"):
                    tensor = _interleave_halves(tensor, heads)
                elif family.interleave_qk and key.endswith("self_attn.k_proj.weight"):
                    tensor = _interleave_halves(tensor, kv_heads)
                head = name == "output.weight" or (tied and name == "token_embd.weight")
                copies = _head_copies(name, tied, plan.quant) if head else [(name, plan.quant)]
                if head and family.head_is_embedding:  # one tensor is both: the head's type wins
                    copies = [(name, copies[-1][1])]
                for written, quant in copies:
                    data, raw = _as_numpy(tensor, quant)
                    writer.add_tensor(written, data, raw_dtype=raw)
                    kind = raw.name if raw is not None else str(data.dtype)
                    counts[kind] = counts.get(kind, 0) + 1
    if not counts:
        raise ExportError(f"{model_dir}: no .safetensors weights to write")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return {
        "tensors": counts,
        "tokens": len(tokens),
        "merges": len(merges),
        "pre_tokenizer": plan.pre,
        **specials,
    }
