"""``slipstream export SOURCE --gguf OUT.gguf``: a merged model written as GGUF, the file llama.cpp, Ollama and
LM Studio read.

What is written (llama.cpp's layout, read with the ``gguf`` package's writer and its tensor-name maps):

- **the architecture's metadata**: context, widths, heads (and the head size where it is not width / heads),
  RoPE base, the RMSNorm epsilon, the vocabulary size; for Gemma (:func:`gemma_keys`) the soft-caps, the
  sliding window and which layers slide (written per layer), the sliding layers' RoPE base and a linear
  RoPE factor on the global layers; for mixtures of experts their count, how many route each token, and
  their width;
- **the tokenizer** the run tokenized with (:func:`vocabulary_of`): every token by id with its type, the
  special ids and the chat template, and either byte-level BPE's merges and the pre-tokenizer llama.cpp must
  split text with (named from the tokenizer's own), or SentencePiece-style BPE's scores (ranked as the
  merges are) and llama.cpp's space prefix (read from the spacing rule). A tokenizer llama.cpp would split
  or space differently from the run is refused;
- **the tensors**: renamed by ``gguf.tensor_mapping``; for the ``llama`` architecture the query and key
  projections reordered within each head, because llama.cpp rotates interleaved pairs where transformers
  rotates the two halves of a head (``_interleave_halves``); an embedding tied to the head written once;
  Gemma's norms written as 1 + weight (transformers' Gemma RMSNorm multiplies by 1 + weight, llama.cpp's by
  the weight it reads; its graph scales the embedding by sqrt(width) itself, and rotates halves as
  transformers does).

Types: ``f32``, ``f16`` and ``bf16`` written here; the block types (``q8_0``, ``q5_x``, ``q4_x``) and the
k-quants (``q6_k`` ... ``q2_k``) made by llama.cpp's own quantizer from the f16 file written here, wherever
llama-cpp-python is installed (:mod:`.gguf_quantize`); without it the block types the ``gguf`` package
quantizes in Python, with norms and biases f32 as llama.cpp's converter keeps them and the LM head f16
(``_head_copies``), and the k-quants refused with the line that installs it.

Families: Llama (SmolLM2 included), Mistral without a sliding window shorter than its context (llama.cpp's
``llama`` architecture has none), Qwen2 / Qwen2.5 and Qwen3, Gemma 2 and Gemma 3 text (llama.cpp's ``gemma2``
/ ``gemma3``), and the mixtures of experts Qwen3-MoE (``qwen3moe``) and Mixtral (``llama`` with experts: each
layer's experts stacked, ``_stacked_experts``). Anything else (another family, another tokenizer, RoPE
scaling other than Llama 3.1's (``rope_freqs.weight``, :func:`llama3_rope_factors`) and Gemma's linear
factor on its global layers, routing llama.cpp does not do, a Gemma that
llama.cpp would run differently: a ``query_pre_attn_scalar`` other than the one llama.cpp assumes, Gemma 2
without soft-caps, Gemma 3 with an attention soft-cap, ...) is refused by name before anything is written.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .gguf_gemma import GEMMA_TYPES, GemmaKeys, _add_gemma_keys, gemma_keys
from .gguf_quantize import IMATRIX_TYPES, INSTALL, K_QUANTS, llama_cpp_available
from .gguf_vocab import Vocabulary, _loaded_tokenizer, _specials, tokens_of, vocabulary_of
from .merged import ExportError

# the block types the gguf package quantizes in Python (llama.cpp's quantizer makes them where installed),
# and the plain ones, written directly
PLAIN_TYPES = ("f32", "f16", "bf16")
PYTHON_TYPES = (*PLAIN_TYPES, "q8_0", "q5_1", "q5_0", "q4_1", "q4_0")
ALL_TYPES = (*PYTHON_TYPES, *K_QUANTS)


@dataclass(frozen=True)
class Family:
    arch: str  # gguf.MODEL_ARCH's name
    interleave_qk: bool  # llama.cpp's llama architecture rotates interleaved pairs: reorder q / k
    # None: transformers' GGUF loader reads the file as this family; else why it cannot (llama.cpp alone checks)
    transformers_misreads: str | None = None
    # Gemma's RMSNorm multiplies by (1 + weight), llama.cpp's by the stored weight: 1 added to every norm
    norm_shift: float = 0.0
    # llama.cpp's gemma2 reads the head from token_embd only (an output.weight is an unexpected tensor)
    head_is_embedding: bool = False


FAMILIES = {
    "llama": Family("LLAMA", True),
    "mistral": Family("LLAMA", True),
    "qwen2": Family("QWEN2", False),
    "qwen3": Family("QWEN3", False),
    "qwen3_moe": Family("QWEN3MOE", False),
    "mixtral": Family(
        "LLAMA", True, "it reads a llama-architecture file as a dense Llama, without Mixtral's experts"
    ),
    "gemma2": Family("GEMMA2", False, norm_shift=1.0, head_is_embedding=True),
    "gemma3_text": Family("GEMMA3", False, norm_shift=1.0),
}


@dataclass
class GGUFPlan:
    """What will be written, decided and checked before anything is: the family, the type, the tokenizer."""

    family: Family
    model_type: str
    quant: str
    config: dict
    tokenizer: dict  # the pipeline the run tokenizes with (the loaded tokenizer's, not the file's: see below)
    vocabulary: Vocabulary
    hf_tokenizer: Any  # the transformers tokenizer itself
    gemma: GemmaKeys | None  # Gemma 2 / 3's keys (None: another family)
    rope_factors: (
        torch.Tensor | None
    )  # Llama 3.1's RoPE divisors, rope_freqs.weight (None: no llama3 scaling)
    # who makes the blocks: "" (a plain type, written directly), "llama.cpp" (its quantizer, from the f16 file
    # written first) or "gguf" (the gguf package in Python: llama-cpp-python is not installed)
    quantizer: str = ""


def quantizer_for(quant: str) -> str:
    """Who quantizes ``quant``: llama.cpp's own quantizer wherever llama-cpp-python is installed (the file
    ``llama-quantize`` would write: its per-tensor types, its head), else the gguf package for the block
    types it has; the k-quants only llama.cpp makes (an ExportError saying how to install it)."""
    if quant in PLAIN_TYPES:
        return ""
    if llama_cpp_available():
        return "llama.cpp"
    if quant in K_QUANTS:
        raise ExportError(f"--quant {quant}: llama.cpp's own quantizer makes it: {INSTALL}")
    return "gguf"


def plan_gguf_type(quant: str) -> tuple[str, str]:
    """``quant`` (any case) and who quantizes it; an ExportError naming a type the export does not write,
    one that needs an importance matrix, or a quantizer that is not installed."""
    quant = quant.lower()
    if quant in IMATRIX_TYPES:
        raise ExportError(
            f"--quant {quant}: llama.cpp makes it from an importance matrix (llama-imatrix over calibration "
            f"text), which the export does not compute; the k-quants need none ({', '.join(K_QUANTS)})"
        )
    if quant not in ALL_TYPES:
        raise ExportError(
            f"--quant {quant}: not a GGUF type the export writes (choose {', '.join(ALL_TYPES)})"
        )
    return quant, quantizer_for(quant)


def plan_gguf(model_dir: Path, quant: str) -> GGUFPlan:
    """Read ``model_dir`` (a merged transformers directory) and refuse, one line naming it, what cannot be
    written exactly: another family, a type llama.cpp quantizes itself, another tokenizer, RoPE scaling."""
    quant, quantizer = plan_gguf_type(quant)
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
    gemma = gemma_keys(model_dir, model_type) if model_type in GEMMA_TYPES else None  # refusals included
    # transformers 5 saves RoPE scaling as rope_parameters (older config.json files: rope_scaling)
    rope = (
        {} if model_type in GEMMA_TYPES else config.get("rope_scaling") or config.get("rope_parameters") or {}
    )
    kind = rope.get("rope_type", rope.get("type")) if isinstance(rope, dict) else None
    if kind == "llama3" and family.arch != "LLAMA":
        raise ExportError(
            f"{model_dir}: RoPE scaling 'llama3' on {model_type}: llama.cpp reads it for llama only"
        )
    if kind not in (None, "default", "llama3"):
        raise ExportError(f"{model_dir}: RoPE scaling {kind!r} is not exported to GGUF yet")
    window = config.get("sliding_window") if config.get("use_sliding_window", True) else None
    if family.arch == "LLAMA" and window is not None and window < config.get("max_position_embeddings", 0):
        raise ExportError(
            f"{model_dir}: sliding_window {window} is shorter than the context "
            f"({config.get('max_position_embeddings')}): llama.cpp's llama architecture has no sliding window"
        )
    if model_type == "qwen3_moe":
        _check_qwen3_moe(config, model_dir)
    hf_tokenizer, tokenizer = _loaded_tokenizer(model_dir)
    vocabulary = vocabulary_of(tokenizer, model_dir / "tokenizer.json")
    rope_factors = llama3_rope_factors(model_dir) if kind == "llama3" else None
    return GGUFPlan(
        family, model_type, quant, config, tokenizer, vocabulary, hf_tokenizer, gemma, rope_factors, quantizer
    )


def llama3_rope_factors(model_dir: Path) -> torch.Tensor | None:
    """Llama 3.1's RoPE scaling as llama.cpp reads it: one divisor per rotated pair (``rope_freqs.weight``),
    the default frequencies over the scaled ones, taken from transformers' own llama3 rule so the file rotates
    as the run's model does; None where the model has no llama3 scaling."""
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = AutoConfig.from_pretrained(model_dir)
    rope = config.rope_parameters or {}
    if rope.get("rope_type") != "llama3":
        return None
    scaled, attention_factor = ROPE_INIT_FUNCTIONS["llama3"](config, torch.device("cpu"))
    if attention_factor != 1.0:
        raise ExportError(
            f"{model_dir}: llama3 RoPE with an attention factor {attention_factor}: not in GGUF"
        )
    dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    default = 1.0 / (rope["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
    return (default / scaled).to(torch.float32)


def _check_qwen3_moe(config: dict, model_dir: Path) -> None:
    """llama.cpp's ``qwen3moe`` routes every layer's tokens by a softmax over the experts, keeps the top k and
    always renormalizes their weights to sum to one: a config that routes otherwise is refused by key."""
    if config.get("norm_topk_prob") is not True:
        raise ExportError(
            f"{model_dir}: norm_topk_prob {config.get('norm_topk_prob')!r}: llama.cpp's qwen3moe always "
            "renormalizes the chosen experts' weights, so its outputs would differ"
        )
    if int(config.get("decoder_sparse_step") or 1) != 1 or config.get("mlp_only_layers"):
        raise ExportError(
            f"{model_dir}: decoder_sparse_step {config.get('decoder_sparse_step')} / mlp_only_layers "
            f"{config.get('mlp_only_layers')}: llama.cpp's qwen3moe has experts in every layer"
        )


_EXPERT = re.compile(
    r"(?P<layer>.+\.(?:mlp|block_sparse_moe)\.experts)\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj|w1|w2|w3)"
    r"\.weight"
)


def _checkpoint(model_dir: Path, *, skip_head: bool):
    """Every tensor of the directory's safetensors files, in file order (a tied head skipped: llama.cpp
    reads it from the embedding)."""
    from safetensors import safe_open

    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as weights:
            for key in weights.keys():  # noqa: SIM118 (safe_open has no __iter__)
                if not (skip_head and key == "lm_head.weight"):
                    yield key, weights.get_tensor(key)


def _stacked_experts(keys_and_tensors, experts: int):
    """The checkpoint's tensors with each layer's experts stacked, as llama.cpp reads them: one
    ``[experts, out, in]`` tensor per projection (``...mlp.experts.gate_proj``), from the per-expert layout
    ``save_pretrained`` writes or from a fused ``gate_up_proj`` (gate rows first, as transformers splits it)."""
    pending: dict[tuple[str, str], dict[int, torch.Tensor]] = {}
    for key, tensor in keys_and_tensors:
        found = _EXPERT.fullmatch(key)
        if found and experts:
            group = pending.setdefault((found["layer"], found["proj"]), {})
            group[int(found["expert"])] = tensor
            if len(group) == experts:
                del pending[(found["layer"], found["proj"])]
                yield (
                    f"{found['layer']}.{found['proj']}.weight",
                    torch.stack([group[e] for e in range(experts)]),
                )
        elif key.endswith("mlp.experts.gate_up_proj"):
            gate, up = tensor.chunk(2, dim=1)
            yield f"{key[: -len('gate_up_proj')]}gate_proj.weight", gate
            yield f"{key[: -len('gate_up_proj')]}up_proj.weight", up
        elif key.endswith("mlp.experts.down_proj"):
            yield f"{key}.weight", tensor
        else:
            yield key, tensor
    if pending:
        (layer, proj), group = next(iter(pending.items()))
        raise ExportError(f"{layer}: {len(group)} of {experts} experts' {proj} in the checkpoint")


def _interleave_halves(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows of each head reordered from (first half, second half) to interleaved pairs (0, d/2, 1, d/2+1, ...):
    transformers' RoPE rotates element i with element i + d/2 of a head, llama.cpp's ``llama`` architecture
    rotates element 2i with 2i + 1, so this order makes llama.cpp rotate the same pairs."""
    rows, cols = weight.shape
    size = rows // heads
    return weight.reshape(heads, 2, size // 2, cols).transpose(1, 2).reshape(rows, cols)


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


def write_gguf(model_dir: Path, out: Path, plan: GGUFPlan, chat_template: str | None) -> dict[str, Any]:
    """Write ``model_dir``'s weights and tokenizer to ``out`` as ``plan`` says; returns the tokenizer and
    special tokens written."""
    import gguf

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
    experts = int(config.get("num_experts") or config.get("num_local_experts") or 0)
    if experts:
        writer.add_expert_count(experts)
        writer.add_expert_used_count(int(config["num_experts_per_tok"]))
        if config.get("moe_intermediate_size"):  # Mixtral's experts are intermediate_size wide
            writer.add_expert_feed_forward_length(int(config["moe_intermediate_size"]))
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(head_dim)  # always: a reader's default head size need not be width / heads
    writer.add_value_length(head_dim)
    rope = config.get("rope_parameters") or {}
    theta = (
        config.get("rope_theta") or (rope.get("rope_theta") if isinstance(rope, dict) else None) or 10000.0
    )
    if plan.gemma is not None:
        theta = plan.gemma.rope_theta
        _add_gemma_keys(writer, plan.gemma)
    writer.add_rope_freq_base(float(theta))
    writer.add_rope_dimension_count(head_dim)
    if plan.rope_factors is not None:  # llama.cpp divides each pair's frequency by its factor
        writer.add_tensor("rope_freqs.weight", plan.rope_factors.numpy())
    writer.add_layer_norm_rms_eps(float(config.get("rms_norm_eps") or 1e-6))
    # gguf's name for each of PYTHON_TYPES: ALL_F32, else MOSTLY_ and the type (MOSTLY_Q8_0)
    file_type = gguf.LlamaFileType["ALL_F32" if plan.quant == "f32" else f"MOSTLY_{plan.quant.upper()}"]
    writer.add_file_type(int(file_type))
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)

    tokens, types, merges, scores = tokens_of(
        plan.tokenizer, plan.vocabulary, plan.hf_tokenizer, int(config.get("vocab_size") or 0)
    )
    vocabulary = plan.vocabulary
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model(vocabulary.model)
    writer.add_tokenizer_pre(vocabulary.pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    if scores is not None:
        writer.add_token_scores(scores)
        writer.add_add_space_prefix(bool(vocabulary.space_prefix))
    else:
        writer.add_token_merges(merges)
    specials = _specials(plan.hf_tokenizer)
    for key, add in (("bos", writer.add_bos_token_id), ("eos", writer.add_eos_token_id),
                     ("unk", writer.add_unk_token_id), ("pad", writer.add_pad_token_id)):  # fmt: skip
        if specials[key] is not None:
            add(int(specials[key]))
    writer.add_add_bos_token(bool(specials["add_bos"]))
    writer.add_add_eos_token(bool(specials["add_eos"]))
    if chat_template:
        writer.add_chat_template(chat_template)

    written_any = False
    # Gemma's configs tie the head unless they say otherwise (an older config.json may not say)
    tied = bool(config.get("tie_word_embeddings", plan.model_type in GEMMA_TYPES))
    for key, tensor in _stacked_experts(_checkpoint(model_dir, skip_head=tied), experts):
        name = names.get_name(key, try_suffixes=(".weight", ".bias"))
        if name is None:
            raise ExportError(f"{model_dir}: tensor {key} has no GGUF name for {plan.model_type}")
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
            written_any = True
    if not written_any:
        raise ExportError(f"{model_dir}: no .safetensors weights to write")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return {  # each tensor's type is read back from the file (gguf_export)
        "tokens": len(tokens),
        "merges": len(merges),
        "tokenizer_model": vocabulary.model,
        "pre_tokenizer": vocabulary.pre,
        "space_prefix": vocabulary.space_prefix,
        **specials,
    }
