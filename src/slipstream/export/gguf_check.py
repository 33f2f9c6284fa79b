"""A written GGUF file loaded back and compared with the merged model it came from, before it is kept.

Two runtimes read it: **transformers' own GGUF loader** (always there: it dequantizes the file into a torch
model and rebuilds the tokenizer from the file's vocabulary and merges) and **llama.cpp** through
``llama-cpp-python`` (the optional ``slipstream[gguf]`` extra: the file as llama.cpp, Ollama and LM Studio
run it). On a fixed set of held prompts, for each runtime:

- the prompts' tokens must be the merged tokenizer's exactly (a pre-tokenizer or a merge list that differs
  shows here first); llama.cpp, which tokenizes with its own code, must also tokenize ``TOKEN_PROBES`` (the
  spacing, byte-fallback and special-token cases where tokenizers part: a leading space, runs of spaces,
  text after a special token) and the model's chat template rendered on a short conversation exactly as the
  merged tokenizer does (transformers' loader rebuilds a tokenizer of its own for the file, not the one the
  run used, so it is held to the prompts only);
- every position's top-1 token, teacher-forced on those tokens, is compared with the merged model's
  (fp32). Where llama.cpp's own converter and quantizer ran on the same model (:mod:`.gguf_reference`),
  llama.cpp must agree within half a point of that file's agreement. ``TOP1_FLOOR[type]`` is a sanity
  bound under it (and the only judge where the reference cannot run). The largest |logit difference| is
  reported;
- greedy continuations of ``GREEDY_TOKENS`` tokens of the first ``GREEDY_PROMPTS`` prompts, counted where
  identical (reported; a quantized model may part late in a continuation and still be right).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from ..noise import quiet_transformers
from .gguf_gemma import llama_cpp_query_scalar

HELD_PROMPTS = (
    "The quick brown fox jumps over the lazy dog while the band plays on in the town square.",
    "Explain, step by step, how a merged adapter keeps the model's answers unchanged after export.",
    "In 1969, 3 astronauts flew 384,400 km to the Moon; 2 of them walked on its surface for 21.5 hours.",
    "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n",
    "Paris is the capital of France. Berlin is the capital of Germany. Rome is the capital of",
    'She said: "Don\'t forget the keys!" — and then she left, closing the door softly behind her.',
    "A recipe for bread: 500 g flour, 350 ml water, 10 g salt and 5 g yeast. Knead, rest, then bake at",
    "Les montagnes et les rivières du pays sont belles au printemps, quand la neige fond lentement.",
    "Question: what is 17 multiplied by 23? Answer: let us work it out carefully, one digit at a time.",
    "The mitochondria is the powerhouse of the cell, producing energy through cellular respiration.",
    "To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer the slings",
    "SELECT name, COUNT(*) FROM orders WHERE total > 100 GROUP BY name ORDER BY 2 DESC LIMIT 10;",
)
# the cases where two tokenizers of the same vocabulary part: spaces at the start and in runs, tabs and line
# ends, characters only bytes spell (SentencePiece's byte fallback), and text that follows a special token
# ("{eos}" is the model's end-of-sequence token)
TOKEN_PROBES = (
    " a leading space, then  two and   three spaces",
    "a trailing space ",
    "tab\tthen new lines\n\nand a carriage return\r\n",
    "accents: d\u00e9j\u00e0 vu, na\u00efve caf\u00e9; kana and kanji: \u304b\u306a\u6f22\u5b57; emoji: \U0001f642\U0001f680",
    "an answer.{eos}The next text, after the end-of-sequence token{eos} and one with a space",
)
CONVERSATION = (
    {"role": "system", "content": "You answer briefly."},
    {"role": "user", "content": " What is the capital of France?"},
    {"role": "assistant", "content": "Paris."},
    {"role": "user", "content": "And of Italy?\n"},
)
GREEDY_PROMPTS = 6
GREEDY_TOKENS = 32
# sanity bounds, not quality targets: a file this far from the merged model is another model (a wrong
# layout, a wrong tokenizer reads near 0%); how close a type can come on a model is the reference file's to
# say. Set under what llama.cpp's own converter + quantizer reach on the real SmolLM2-135M (BENCHMARKS.md,
# issue 64: q8_0 95.1%, q6_k 93.0%, q5_k_m 78.0%, q4_k_m 82.9-85.1%, q3_k_m 78.0%, q2_k 59.5% in llama.cpp),
# so that a small model's own llama.cpp file passes them
TOP1_FLOOR = {
    "f32": 0.99, "f16": 0.99, "bf16": 0.99, "q8_0": 0.93, "q6_k": 0.90,
    "q5_1": 0.75, "q5_0": 0.75, "q5_k_m": 0.75, "q5_k_s": 0.75,
    "q4_1": 0.75, "q4_0": 0.75, "q4_k_m": 0.75, "q4_k_s": 0.75,
    "q3_k_l": 0.65, "q3_k_m": 0.65, "q3_k_s": 0.65, "q2_k": 0.50,
}  # fmt: skip


@dataclass
class GGUFCheck:
    """One runtime's agreement with the merged model on the held prompts."""

    runtime: str
    positions: int
    top1: float  # the share of positions whose top-1 token agrees
    max_abs: float  # the largest |logit difference| over every position and token
    greedy_same: int  # greedy continuations identical to the merged model's
    greedy_total: int
    floor: float
    tokens_match: bool  # the runtime's tokens of the held prompts are the merged tokenizer's
    probe_mismatch: str | None = None  # the first probe the runtime tokenizes differently (None: all agree)
    probes: int = 0  # how many probes were compared
    floor_reason: str = ""  # where the floor came from, where not TOP1_FLOOR (the reference file's top-1)

    @property
    def ok(self) -> bool:
        return self.tokens_match and self.probe_mismatch is None and self.top1 >= self.floor

    def describe(self) -> str:
        tokens = "" if self.tokens_match else "its tokens of the held prompts differ from the model's; "
        if self.probe_mismatch is not None:
            tokens += f"it tokenizes {self.probe_mismatch[:60]!r} differently from the model; "
        elif self.tokens_match and self.probes:
            tokens = f"tokens identical on the held prompts and {self.probes} tokenization probes; "
        return (
            f"{self.runtime}: {tokens}top-1 agrees on {self.top1:.1%} of {self.positions} positions (at least "
            f"{self.floor:.1%} needed{self.floor_reason}), max |logit difference| {self.max_abs:.3g}, greedy {GREEDY_TOKENS}-token "
            f"continuations identical on {self.greedy_same} of {self.greedy_total} prompts"
        )


@dataclass
class Reference:
    """The merged model's view of the held prompts: their tokens, logits and greedy continuations."""

    ids: list[list[int]]
    logits: list[torch.Tensor]  # [positions, vocab] fp32 per prompt
    greedy: list[list[int]]
    probes: dict[str, list[int]]  # each tokenization probe's text (the chat rendering too) -> its tokens


def probe_texts(tokenizer) -> list[str]:
    """``TOKEN_PROBES`` with the model's end-of-sequence token, and the chat template on ``CONVERSATION``."""
    eos = tokenizer.eos_token or ""
    texts = [probe.replace("{eos}", eos) for probe in TOKEN_PROBES]
    if isinstance(tokenizer.chat_template, str):
        for conversation in (list(CONVERSATION), list(CONVERSATION[1:])):  # some templates refuse a system
            try:
                texts.append(tokenizer.apply_chat_template(conversation, tokenize=False))
                break
            except Exception:  # noqa: BLE001 (a template's own raise_exception: try without a system turn)
                continue
    return texts


@torch.no_grad()
def _hf_greedy(model, prompt: list[int]) -> list[int]:
    """``GREEDY_TOKENS`` greedy tokens after ``prompt``, the KV cache kept (one new token a forward)."""
    found = model(input_ids=torch.tensor([prompt]), use_cache=True, logits_to_keep=1)
    ids: list[int] = []
    for _ in range(GREEDY_TOKENS):
        ids.append(int(found.logits[0, -1].argmax()))
        found = model(
            input_ids=torch.tensor([ids[-1:]]), past_key_values=found.past_key_values, use_cache=True
        )
    return ids


@torch.no_grad()
def reference(model_dir: Path) -> Reference:
    """The merged model (fp32) on the held prompts."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = [tokenizer(text)["input_ids"] for text in HELD_PROMPTS]
    logits = [model(input_ids=torch.tensor([row])).logits[0].float() for row in ids]
    greedy = [_hf_greedy(model, row) for row in ids[:GREEDY_PROMPTS]]
    probes = {text: tokenizer(text, add_special_tokens=False)["input_ids"] for text in probe_texts(tokenizer)}
    return Reference(ids, logits, greedy, probes)


def _compare(
    runtime: str, ref: Reference, ids, logits, greedy, quant: str, probes: dict[str, list[int]] | None = None
) -> GGUFCheck:
    agree = positions = 0
    max_abs = 0.0
    for expected, found in zip(ref.logits, logits, strict=True):
        width = min(expected.shape[-1], found.shape[-1])
        expected, found = expected[:, :width], found[:, :width]
        agree += int((expected.argmax(-1) == found.argmax(-1)).sum())
        positions += expected.shape[0]
        max_abs = max(max_abs, float((expected - found).abs().max()))
    same = sum(a == b for a, b in zip(ref.greedy, greedy, strict=True))
    probes = probes or {}
    mismatch = next((text for text, found in probes.items() if found != ref.probes[text]), None)
    return GGUFCheck(
        runtime,
        positions,
        agree / positions,
        max_abs,
        same,
        len(ref.greedy),
        TOP1_FLOOR[quant],
        ids == ref.ids,
        mismatch,
        len(probes),
    )


@torch.no_grad()
def check_transformers(gguf_path: Path, ref: Reference, quant: str) -> GGUFCheck:
    """The file as transformers' GGUF loader reads it (dequantized to fp32)."""
    from gguf import GGUFReader
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf_path.parent), gguf_path.name
    with quiet_transformers():
        tokenizer = _gguf_tokenizer(AutoTokenizer, folder, name)
        config = AutoConfig.from_pretrained(folder, gguf_file=name)
        # the loader's map skips the head size for some families (Qwen3: its config then defaults to 128):
        # taken from the file, as llama.cpp takes it
        reader = GGUFReader(str(gguf_path))
        fields = reader.fields
        arch = fields["general.architecture"].contents()
        if f"{arch}.attention.key_length" in fields:
            config.head_dim = int(fields[f"{arch}.attention.key_length"].contents())
        if f"{arch}.expert_feed_forward_length" in fields:  # Qwen3-MoE's expert width, skipped the same way
            config.moe_intermediate_size = int(fields[f"{arch}.expert_feed_forward_length"].contents())
        if arch in ("gemma2", "gemma3"):
            _gemma_from_file(config, fields, arch)
        model = AutoModelForCausalLM.from_pretrained(
            folder, gguf_file=name, config=config, dtype=torch.float32
        ).eval()
        _apply_rope_freqs(model, reader)
    ids = [tokenizer(text)["input_ids"] for text in HELD_PROMPTS]
    # the file's add-BOS rule, where an older loader (5.17) drops it for SentencePiece
    if "tokenizer.ggml.add_bos_token" in fields and fields["tokenizer.ggml.add_bos_token"].contents():
        bos = fields["tokenizer.ggml.bos_token_id"].contents()
        ids = [row if row[:1] == [bos] else [bos, *row] for row in ids]
    logits = [model(input_ids=torch.tensor([row])).logits[0].float() for row in ref.ids]
    greedy = [_hf_greedy(model, row) for row in ref.ids[:GREEDY_PROMPTS]]
    return _compare("transformers' GGUF loader", ref, ids, logits, greedy, quant)


def _gemma_from_file(config, fields, arch: str) -> None:
    """transformers' GGUF loader maps only Gemma's common keys (widths, heads, window size) and leaves the
    rest at its config class's defaults (Gemma 2's soft-caps 50 / 30, a query scale of 1/sqrt(256), every
    sixth layer global, Gemma 3's RoPE bases), so those are read from the file here as llama.cpp reads them
    (``llama_model_gemma2`` / ``gemma3::load_arch_hparams``), llama.cpp's defaults where a key is absent."""

    def get(key: str, default=None):
        field = fields.get(f"{arch}.{key}")
        return default if field is None else field.contents()

    gemma2 = arch == "gemma2"
    layers, width, heads = config.num_hidden_layers, config.hidden_size, config.num_attention_heads
    config.query_pre_attn_scalar = llama_cpp_query_scalar(
        "gemma2" if gemma2 else "gemma3_text", layers, width, heads, config.head_dim
    )
    if gemma2:  # always soft-capped
        config.attn_logit_softcapping = float(get("attn_logit_softcapping", 50.0))
        config.final_logit_softcapping = float(get("final_logit_softcapping", 30.0))
    else:
        config.attn_logit_softcapping = None
        config.final_logit_softcapping = float(get("final_logit_softcapping", 0.0)) or None
    window = int(get("attention.sliding_window", 4096 if gemma2 else 0))
    pattern = get("attention.sliding_window_pattern", 2 if gemma2 else 6)
    if isinstance(pattern, list):  # which layers slide, per layer
        swa = [bool(x) for x in pattern]
    else:  # a period: all but the last layer of each period slide (llama_hparams::set_swa_pattern)
        swa = [pattern == 0 or il % pattern < pattern - 1 for il in range(layers)]
    if not window:  # gemma3 without a window: no layer slides
        swa = [False] * layers
    config.sliding_window = window or config.max_position_embeddings  # transformers builds the mask anyway
    config.layer_types = ["sliding_attention" if s else "full_attention" for s in swa]
    theta = float(get("rope.freq_base", 10000.0))
    full = {"rope_type": "default", "rope_theta": theta}
    factor = get("rope.scaling.factor", get("rope.scale_linear", 0.0))
    if factor and get("rope.scaling.type", "linear") == "linear":
        full = {"rope_type": "linear", "factor": float(factor), "rope_theta": theta}
    if gemma2:  # one RoPE for every layer (llama.cpp copies the global base and scale to the sliding ones)
        config.rope_parameters = full
    else:
        local = {"rope_type": "default", "rope_theta": float(get("rope.freq_base_swa", 10000.0))}
        config.rope_parameters = {"full_attention": full, "sliding_attention": local}


def _apply_rope_freqs(model, reader) -> None:
    """The file's ``rope_freqs.weight`` (Llama 3.1's RoPE scaling: a divisor per rotated pair), which the
    loader skips, applied to the loaded model's rotary frequencies as llama.cpp applies it."""
    import numpy as np

    found = [tensor for tensor in reader.tensors if tensor.name == "rope_freqs.weight"]
    if not found:
        return
    factors = torch.from_numpy(np.array(found[0].data, dtype=np.float32))
    rotary = model.model.rotary_emb
    rotary.inv_freq = rotary.inv_freq / factors
    rotary.original_inv_freq = rotary.inv_freq


def _gguf_tokenizer(auto, folder: str, name: str):
    """transformers' tokenizer rebuilt from the file; a loader that cannot (older transformers: a llama
    tokenizer without BOS) is an ExportError naming it, never a traceback."""
    import transformers

    from .merged import ExportError

    try:
        return auto.from_pretrained(folder, gguf_file=name)
    except (AttributeError, KeyError, ValueError, TypeError) as error:
        raise ExportError(
            f"transformers {transformers.__version__}'s GGUF loader cannot rebuild this file's tokenizer "
            f"({type(error).__name__}: {error}); a newer transformers can, or --no-verify writes it unchecked"
        ) from None


def check_llama_cpp(gguf_path: Path, ref: Reference, quant: str, add_bos: bool) -> GGUFCheck:
    """The file as llama.cpp runs it (``llama-cpp-python``), every position's logits kept."""
    import llama_cpp

    context = max(len(row) for row in ref.ids) + GREEDY_TOKENS + 8
    llm = llama_cpp.Llama(
        model_path=str(gguf_path), n_ctx=context, logits_all=True, verbose=False, n_threads=None, seed=0
    )
    ids = [llm.tokenize(text.encode("utf-8"), add_bos=add_bos, special=True) for text in HELD_PROMPTS]
    probes = {text: llm.tokenize(text.encode("utf-8"), add_bos=False, special=True) for text in ref.probes}

    def run(row: list[int]) -> torch.Tensor:
        llm.reset()
        llm.eval(row)
        return torch.tensor(llm.scores[: len(row)], dtype=torch.float32)

    def greedy_after(row: list[int]) -> list[int]:
        found: list[int] = []
        last = run(row)[-1]
        for _ in range(GREEDY_TOKENS):
            found.append(int(last.argmax()))
            llm.eval(found[-1:])  # one token more on llama.cpp's own cache
            last = torch.tensor(llm.scores[llm.n_tokens - 1], dtype=torch.float32)
        return found

    logits = [run(row) for row in ref.ids]
    greedy = [greedy_after(row) for row in ref.ids[:GREEDY_PROMPTS]]
    llm.close()
    return _compare("llama.cpp", ref, ids, logits, greedy, quant, probes)
