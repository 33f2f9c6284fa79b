"""One demo tokenizer per test session, built into a temporary cache (about a second)."""

from __future__ import annotations

import pytest

from slipstream.data import demo_tokenizer
from slipstream.data.labels import IGNORE_INDEX


@pytest.fixture(scope="session")
def tokenizer_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("slipstream-cache")


@pytest.fixture(scope="session")
def tokenizer(tokenizer_cache):
    return demo_tokenizer(tokenizer_cache)


@pytest.fixture
def plain_tokenizer(tokenizer_cache):
    """The demo tokenizer without a chat template (Alpaca rows fall back to plain text)."""
    loaded = demo_tokenizer(tokenizer_cache)  # from the cache: a fresh object we may change
    loaded.chat_template = None
    return loaded


def labelled_runs(sample):
    """The contiguous runs of labelled tokens of a sample, each as a list of ids (each label its token)."""
    runs, current = [], []
    for token, label in zip(sample["input_ids"], sample["labels"], strict=True):
        if label == IGNORE_INDEX:
            if current:
                runs.append(current)
            current = []
        else:
            assert label == token
            current.append(token)
    return runs + ([current] if current else [])
