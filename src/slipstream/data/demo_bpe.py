"""The demo tokenizer: a 2048-token byte-level BPE trained on the demo data, cached on disk.

Nothing can come from a model hub, so the demo trains its own tokenizer (about a second)
on chats rendered from ``demo_rows(..., seed=12345)`` with a ChatML-style template, and
keeps it under ``$SLIPSTREAM_CACHE`` (default ``~/.cache/slipstream``) in a folder named
after a hash of the recipe: change the recipe, or the demo data's source, and a fresh
folder is built. The folder appears atomically (built beside it, then renamed), so a
reader never sees half a tokenizer and two concurrent builders both end up with one.
"""

from __future__ import annotations

import hashlib
import inspect
import json
from pathlib import Path
from typing import Any

import jinja2
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from ..atomic import atomic_directory
from . import demo_data
from .cache import cache_root
from .demo_data import demo_rows
from .shapes import tokenize_row

VOCAB_SIZE = 2048
END_OF_TEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TRAINING_ROWS, TRAINING_SEED = 3000, 12345
RECIPE_VERSION = 1  # bump when the build below changes in a way the hash cannot see


def demo_tokenizer(cache_dir: str | Path | None = None) -> PreTrainedTokenizerFast:
    """The demo tokenizer, built on first use and loaded from the cache after that."""
    root = Path(cache_dir) if cache_dir is not None else cache_root()
    folder = root / f"demo-tokenizer-v{RECIPE_VERSION}-{_recipe_hash()}"
    if not (folder / "tokenizer.json").exists():
        # a concurrent builder that renamed its copy first wins: its copy is used
        with atomic_directory(folder, existing="keep") as staging:
            _train().save_pretrained(str(staging))
    return PreTrainedTokenizerFast.from_pretrained(str(folder), local_files_only=True)


def demo_samples(
    tokenizer: Any = None, num_rows: int = 2000, seed: int = 0, response_only: bool = False
) -> list[dict[str, list[int]]]:
    """``demo_rows`` tokenized (with the demo tokenizer unless another is given)."""
    tokenizer = tokenizer if tokenizer is not None else demo_tokenizer()
    rows = demo_rows(num_rows, seed)
    return [
        tokenize_row(row, tokenizer, response_only, f"demo row {index}") for index, row in enumerate(rows)
    ]


def _recipe_hash() -> str:
    recipe = {
        "version": RECIPE_VERSION,
        "vocab_size": VOCAB_SIZE,
        "special_tokens": [END_OF_TEXT, IM_START, IM_END],
        "chat_template": CHAT_TEMPLATE,
        "training_rows": [TRAINING_ROWS, TRAINING_SEED],
        "demo_data_source": _source_digest(),
        "tokenizers": tokenizers.__version__,
    }
    return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:12]


def _source_digest() -> str:
    """A digest of the demo data's source, so editing the tasks rebuilds the tokenizer."""
    try:
        return hashlib.sha256(inspect.getsource(demo_data).encode()).hexdigest()
    except (OSError, TypeError):  # installed without sources: fall back on RECIPE_VERSION alone
        return "no source"


def _train() -> PreTrainedTokenizerFast:
    render = jinja2.Environment(trim_blocks=True, lstrip_blocks=True).from_string(CHAT_TEMPLATE).render
    texts = [
        render(messages=row["messages"], add_generation_prompt=False)
        for row in demo_rows(TRAINING_ROWS, TRAINING_SEED)
    ]
    bpe = tokenizers.Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=[END_OF_TEXT, IM_START, IM_END],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        eos_token=END_OF_TEXT,
        pad_token=END_OF_TEXT,
        extra_special_tokens=[IM_START, IM_END],
        chat_template=CHAT_TEMPLATE,
    )
