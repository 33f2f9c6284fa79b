"""The demo data (learnable, long-tailed) and the demo tokenizer (cached, deterministic)."""

from __future__ import annotations

import os
import re
import shutil
import statistics
from pathlib import Path

import pytest

from slipstream import atomic
from slipstream.data import cache_root, demo_bpe, demo_rows, demo_samples, demo_tokenizer, tokenize_row


def test_rows_are_deterministic_per_seed():
    assert demo_rows(50, seed=1) == demo_rows(50, seed=1)
    assert demo_rows(50, seed=1) != demo_rows(50, seed=2)


def check_answer(prompt: str, answer: str) -> None:
    if prompt.startswith("Add each pair: "):
        pairs = prompt.removeprefix("Add each pair: ").split("; ")
        assert answer == "; ".join(str(int(a) + int(b)) for a, b in (pair.split("+") for pair in pairs))
    elif prompt.startswith("Reverse the words: "):
        assert answer.split() == prompt.removeprefix("Reverse the words: ").split()[::-1]
    else:
        facts, questions = prompt.removeprefix("Remember: ").split(". Question: ")
        values = dict(fact.split("=") for fact in facts.split(", "))
        assert answer == "; ".join(values[key] for key in re.findall(r"what is (k\d+)\?", questions))


def test_rows_are_three_tasks_with_correct_answers():
    rows = demo_rows(300, seed=5)
    kinds = {row["messages"][0]["content"].split(":")[0] for row in rows}
    assert kinds == {"Add each pair", "Reverse the words", "Remember"}
    for row in rows:
        user, assistant = row["messages"]
        assert (user["role"], assistant["role"]) == ("user", "assistant")
        check_answer(user["content"], assistant["content"])


def test_length_distribution_in_tokens(tokenizer):
    lengths = sorted(len(sample["input_ids"]) for sample in demo_samples(tokenizer, num_rows=2000))
    over = sum(length > 2048 for length in lengths) / len(lengths)
    assert 250 <= statistics.median(lengths) <= 400
    assert 0.005 <= over <= 0.04
    assert lengths[-1] < 4096


def test_response_only_demo_labels_the_answer(tokenizer):
    row = demo_rows(1, seed=9)[0]
    sample = tokenize_row(row, tokenizer, response_only=True)
    labelled = [
        token for token, label in zip(sample["input_ids"], sample["labels"], strict=True) if label != -100
    ]
    assert tokenizer.decode(labelled) == row["messages"][1]["content"] + "<|im_end|>"


def test_tokenizer_shape(tokenizer):
    assert len(tokenizer) == 2048
    assert tokenizer.eos_token == tokenizer.pad_token == "<|endoftext|>"
    assert {"<|im_start|>", "<|im_end|>"} <= set(tokenizer.all_special_tokens)
    chat = [{"role": "user", "content": "hi"}]
    text = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.decode(tokenizer("Add each pair: 12+7")["input_ids"]) == "Add each pair: 12+7"


def test_tokenizer_is_cached_and_loaded_from_the_cache(tokenizer, tokenizer_cache, monkeypatch):
    folders = [path.name for path in tokenizer_cache.iterdir()]
    assert len(folders) == 1 and folders[0].startswith("demo-tokenizer-v")  # no staging folder left behind
    monkeypatch.setattr(demo_bpe, "_train", lambda: pytest.fail("rebuilt despite the cache"))
    assert demo_tokenizer(tokenizer_cache).get_vocab() == tokenizer.get_vocab()


def test_cache_location_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("SLIPSTREAM_CACHE", str(tmp_path))
    assert cache_root() == tmp_path
    monkeypatch.delenv("SLIPSTREAM_CACHE")
    assert str(cache_root()).endswith(os.path.join(".cache", "slipstream"))


def test_two_fresh_builds_are_identical(tokenizer, tmp_path):
    rebuilt = demo_tokenizer(tmp_path)
    assert rebuilt.get_vocab() == tokenizer.get_vocab()
    assert rebuilt.backend_tokenizer.to_str() == tokenizer.backend_tokenizer.to_str()


def test_a_concurrent_builder_that_won_the_race_is_used(tokenizer, tokenizer_cache, tmp_path, monkeypatch):
    built = next(tokenizer_cache.iterdir())
    real_replace = os.replace

    def replace_after_another_builder(source, target):
        if Path(target).name == built.name:
            shutil.copytree(built, target)  # the other builder's copy lands first
        real_replace(source, target)

    monkeypatch.setattr(demo_bpe, "_train", lambda: tokenizer)
    monkeypatch.setattr(atomic.os, "replace", replace_after_another_builder)
    assert demo_tokenizer(tmp_path).get_vocab() == tokenizer.get_vocab()
    assert [path.name for path in tmp_path.iterdir()] == [built.name]
