"""A small SentencePiece-style BPE tokenizer made here (no hub): byte-fallback pieces <0x00>..<0xFF>, "▁" for
spaces, and merges listed as a SentencePiece conversion lists them (every pair whose join is a token, in the
joined token's order), in the three spacing pipelines transformers writes: Llama 2's and Mistral's own
``tokenizer.json`` (``legacy``: a normalizer that prepends "▁"), Gemma's (no space prefix), and transformers
5's ``LlamaTokenizer`` (a ``Metaspace`` pre-tokenizer that prepends only to the first text)."""

from __future__ import annotations

import json
from pathlib import Path

CORPUS = (
    "The quick brown fox jumps over the lazy dog while the band plays on in the town square. "
    "Explain, step by step, how a merged adapter keeps the model's answers unchanged after export. "
    "Paris is the capital of France. Berlin is the capital of Germany. Rome is the capital of Italy. "
    "What is the capital of Spain? Madrid. You answer briefly and carefully, one step at a time. "
    "def fibonacci(n): return a if n else b; SELECT name FROM orders WHERE total > 100 ORDER BY name; "
    "The mitochondria is the powerhouse of the cell, producing energy through cellular respiration. "
    "To be, or not to be, that is the question: whether it is nobler in the mind to suffer the slings. "
    "Les montagnes et les rivieres du pays sont belles au printemps, quand la neige fond lentement. "
)
SPECIALS = ("<unk>", "<s>", "</s>")
CHATML = ("<|im_start|>", "<|im_end|>")
CHATML_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% endif %}"
)
LEGACY_NORMALIZER = {
    "type": "Sequence",
    "normalizers": [
        {"type": "Prepend", "prepend": "\u2581"},
        {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"},
    ],
}
GEMMA_NORMALIZER = {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"}


def _pieces(size: int) -> list[str]:
    """Pieces learned by BPE over ``CORPUS``'s words ("▁" for a space), in the order they were learned."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    learner = Tokenizer(models.BPE())
    learner.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="\u2581", prepend_scheme="always", split=True
    )
    trainer = trainers.BpeTrainer(vocab_size=size, show_progress=False)
    learner.train_from_iterator([CORPUS] * 4, trainer)
    vocab = learner.get_vocab()
    return sorted(vocab, key=vocab.__getitem__)


def spm_tokenizer_json(size: int = 700, spacing: str = "legacy") -> dict:
    """``tokenizer.json`` of the tokenizer; ``spacing`` "legacy" (Llama 2), "gemma" or "metaspace-first"."""
    from transformers.tokenization_utils_base import generate_merges

    vocab: dict[str, int] = {}
    for text in [*SPECIALS, *(f"<0x{byte:02X}>" for byte in range(256)), *_pieces(size)]:
        vocab.setdefault(text, len(vocab))
    merges = generate_merges(vocab)  # every pair whose join is a token, ordered by the joined token's id
    added = [
        {"id": vocab[text], "content": text, "single_word": False, "lstrip": False, "rstrip": False,
         "normalized": False, "special": True}
        for text in SPECIALS
    ]  # fmt: skip
    for text in CHATML:
        added.append({**added[0], "id": len(vocab), "content": text})
        vocab[text] = len(vocab)
    decoders = [
        {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "},
        {"type": "ByteFallback"},
        {"type": "Fuse"},
    ]
    normalizer, pre_tokenizer = LEGACY_NORMALIZER, None
    if spacing == "gemma":
        normalizer = GEMMA_NORMALIZER
    elif spacing == "metaspace-first":
        normalizer = None
        pre_tokenizer = {
            "type": "Metaspace",
            "replacement": "\u2581",
            "prepend_scheme": "first",
            "split": False,
        }
    if spacing != "gemma":
        decoders.append({"type": "Strip", "content": " ", "start": 1, "stop": 0})
    bos = {"SpecialToken": {"id": "<s>", "type_id": 0}}
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": normalizer,
        "pre_tokenizer": pre_tokenizer,
        "post_processor": {
            "type": "TemplateProcessing",
            "single": [bos, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [bos, {"Sequence": {"id": "A", "type_id": 0}}, bos, {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {"<s>": {"id": "<s>", "ids": [vocab["<s>"]], "tokens": ["<s>"]}},
        },
        "decoder": {"type": "Sequence", "decoders": decoders},
        "model": {
            "type": "BPE", "dropout": None, "unk_token": "<unk>", "continuing_subword_prefix": None,
            "end_of_word_suffix": None, "fuse_unk": True, "byte_fallback": True, "ignore_merges": False,
            "vocab": {text: i for text, i in vocab.items() if text not in CHATML},
            "merges": [list(pair) for pair in merges],
        },
    }  # fmt: skip


def save_spm_tokenizer(
    folder: Path, spacing: str = "legacy", tokenizer_class: str = "PreTrainedTokenizerFast"
):
    """The tokenizer written to ``folder`` (with a ChatML template) and loaded back as transformers loads it."""
    from transformers import AutoTokenizer

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tokenizer.json").write_text(
        json.dumps(spm_tokenizer_json(spacing=spacing), ensure_ascii=False)
    )
    config = {
        "tokenizer_class": tokenizer_class,
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "chat_template": CHATML_TEMPLATE,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return AutoTokenizer.from_pretrained(folder)
