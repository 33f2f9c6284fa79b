"""The tokenizer half of the GGUF export: which llama.cpp tokenizer reproduces the run's, and its tokens.

llama.cpp tokenizes with its own code, from what the file says: byte-level BPE (``gpt2``: merges, and a
pre-tokenizer named from a fixed list) or SentencePiece-style BPE (``llama``: scores, byte tokens, and a
space prefix). :func:`vocabulary_of` names the one that splits and spaces text exactly as the run's tokenizer
(as transformers loaded it) does, or refuses; :func:`tokens_of` lists what is written.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .merged import ExportError

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


@dataclass(frozen=True)
class Vocabulary:
    """How llama.cpp must tokenize: its tokenizer model, its pre-tokenizer, and (SentencePiece) the space."""

    model: str  # tokenizer.ggml.model: "gpt2" (byte-level BPE), "llama" (SentencePiece's BPE, bytes <0xXX>)
    pre: str  # tokenizer.ggml.pre
    space_prefix: bool | None = None  # SentencePiece: a space before every text after the start or a special


_SPACE_TO_METASPACE = {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"}
_PREPEND_METASPACE = {"type": "Prepend", "prepend": "\u2581"}


def _normalizers(tokenizer_json: dict) -> list[dict]:
    found = tokenizer_json.get("normalizer") or {}
    parts = found.get("normalizers") if found.get("type") == "Sequence" else [found]
    return [part for part in parts or [] if part]


def spm_space_prefix(tokenizer_json: dict) -> bool | None:
    """llama.cpp's ``add_space_prefix`` for a SentencePiece-style BPE tokenizer whose spacing it reproduces
    exactly; None where it cannot.

    llama.cpp's SentencePiece tokenizer turns spaces into "▁" and, with ``add_space_prefix``, puts one space
    before every piece of text that starts the input or follows a special token, whatever the text starts
    with. transformers writes that rule two ways, and one of them differs:

    - ``Prepend("▁")`` then ``Replace(" ", "▁")`` as the normalizer (Llama 2's and Mistral's own
      ``tokenizer.json``, loaded as they are): the same rule, so ``True``;
    - ``Replace(" ", "▁")`` alone (Gemma), or a ``Metaspace`` pre-tokenizer that never prepends: no space,
      so ``False``;
    - a ``Metaspace`` pre-tokenizer that prepends ("first" or "always": what transformers 5's
      ``LlamaTokenizer`` rebuilds any llama tokenizer as) skips text that already starts with a space, and
      "first" skips text after a special token: a chat turn would start with other tokens in llama.cpp
      than in the run, so None.
    """
    normalizers = _normalizers(tokenizer_json)
    pre = tokenizer_json.get("pre_tokenizer") or {}
    pre_parts = pre.get("pretokenizers") if pre.get("type") == "Sequence" else [pre]
    pre_parts = [part for part in pre_parts or [] if part]
    # Gemma splits on " " after its normalizer has replaced every " ": it never splits anything
    split_on_space = {"type": "Split", "pattern": {"String": " "}}
    inert = bool(normalizers) and all(_matches(part, split_on_space) for part in pre_parts)
    if pre_parts and not inert:
        never = {"type": "Metaspace", "replacement": "\u2581", "split": False, "prepend_scheme": "never"}
        return False if len(pre_parts) == 1 and not normalizers and _matches(pre_parts[0], never) else None
    if normalizers == [_PREPEND_METASPACE, _SPACE_TO_METASPACE]:
        return True
    if normalizers == [_SPACE_TO_METASPACE]:
        return False
    return None


def vocabulary_of(tokenizer_json: dict, where: Path) -> Vocabulary:
    """The vocabulary llama.cpp reads for ``tokenizer_json`` (the pipeline the run tokenizes with), or an
    ExportError naming what llama.cpp would tokenize differently."""
    model = tokenizer_json.get("model") or {}
    decoders = tokenizer_json.get("decoder") or {}
    decoder_types = {d.get("type") for d in decoders.get("decoders") or [decoders]}
    if model.get("type") == "BPE" and not model.get("byte_fallback") and decoder_types == {"ByteLevel"}:
        pre = pre_tokenizer_name(tokenizer_json)
        if pre is None:
            raise ExportError(
                f"{where}: its pre-tokenizer ({json.dumps(tokenizer_json.get('pre_tokenizer'))[:120]}) is not "
                "one llama.cpp reproduces, so llama.cpp would split text differently from the run"
            )
        return Vocabulary("gpt2", pre)
    if model.get("type") == "BPE" and model.get("byte_fallback") and "ByteFallback" in decoder_types:
        prefix = spm_space_prefix(tokenizer_json)
        if prefix is None:
            raise ExportError(
                f"{where}: a SentencePiece-style tokenizer whose spacing llama.cpp does not reproduce "
                f"(normalizer {json.dumps(tokenizer_json.get('normalizer'))[:80]}, pre-tokenizer "
                f"{json.dumps(tokenizer_json.get('pre_tokenizer'))[:100]}): llama.cpp puts a space before "
                "every text after the start or a special token, this tokenizer does not, so chat turns "
                "would be tokenized differently from the run"
            )
        return Vocabulary("llama", "default", prefix)
    raise ExportError(
        f"{where}: a {model.get('type')} tokenizer (byte_fallback {model.get('byte_fallback')}, decoder "
        f"{sorted(t for t in decoder_types if t)}): the GGUF export writes byte-level BPE and SentencePiece-style "
        "BPE tokenizers only"
    )


def _loaded_tokenizer(model_dir: Path) -> tuple[Any, dict]:
    """The transformers tokenizer the run used, and its pipeline as ``tokenizer.json`` writes it. The loaded
    one, not the file: transformers 5 rebuilds some classes' pipelines on load (``LlamaTokenizer`` replaces a
    file's normalizer with a ``Metaspace`` pre-tokenizer), and the run tokenized with the rebuilt one."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
    except (OSError, ValueError, TypeError, KeyError) as error:
        raise ExportError(f"{model_dir}: cannot load its tokenizer ({error})") from None
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise ExportError(
            f"{model_dir}: its tokenizer ({type(tokenizer).__name__}) has no tokenizer.json pipeline to export"
        )
    return tokenizer, json.loads(backend.to_str())


def tokens_of(
    tokenizer_json: dict, vocabulary: Vocabulary, hf_tokenizer, vocab_size: int
) -> tuple[list[str], list[int], list[str], list[float] | None]:
    """Every token by id, its llama.cpp type, the merges as ``"left right"`` (byte-level BPE) and the
    scores (SentencePiece: llama.cpp merges the adjacent pair whose joined token scores highest)."""
    from gguf import TokenType

    model = tokenizer_json["model"]
    spm = vocabulary.model == "llama"
    by_id: dict[int, str] = {int(i): text for text, i in model["vocab"].items()}
    kinds: dict[int, int] = {}
    for added in tokenizer_json.get("added_tokens") or []:
        by_id[int(added["id"])] = added["content"]
        kinds[int(added["id"])] = TokenType.CONTROL if added.get("special") else TokenType.USER_DEFINED
    unk = hf_tokenizer.unk_token_id
    if spm and unk is not None:
        kinds[int(unk)] = TokenType.UNKNOWN
    size = max(vocab_size, max(by_id) + 1)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges") or []]
    scores = _merge_scores(merges) if spm else None
    tokens, types, token_scores = [], [], []
    for i in range(size):
        if i in by_id:
            text = by_id[i]
            tokens.append(text)
            kind = kinds.get(i, TokenType.NORMAL)
            if spm and kind == TokenType.NORMAL and _BYTE_TOKEN.fullmatch(text):
                kind = TokenType.BYTE  # <0xXX>: the fallback for a character with no token
            types.append(int(kind))
            token_scores.append(scores.get(text, 0.0) if scores is not None else 0.0)
        else:  # the embedding has rows past the tokenizer's ids: padding llama.cpp never produces
            tokens.append(f"[PAD{i}]")
            types.append(int(TokenType.UNUSED))
            token_scores.append(0.0)
    if spm:
        return tokens, types, [], token_scores
    return tokens, types, merges, None


_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")


def _merge_scores(merges: list[str]) -> dict[str, float]:
    """Each merged token's score from its merge's rank: the first merge that makes a token scores highest.

    transformers' BPE merges the adjacent pair of lowest rank in ``merges``; llama.cpp's SentencePiece
    tokenizer merges the adjacent pair whose joined token has the highest score. Scoring a token minus the
    rank of the first merge that makes it orders llama.cpp's choices as transformers' ranks order them. A
    tokenizer converted from SentencePiece lists every pair whose join is a token (that is how its merges
    are made), so llama.cpp finds no pair transformers would not merge; one that does not is caught by the
    verification's tokens."""
    scores: dict[str, float] = {}
    for rank, merge in enumerate(merges):
        left, _, right = merge.partition(" ")
        scores.setdefault(left + right, -float(rank))
    return scores


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
