"""The one token-id check train's preflight and the A/B both run (data/token_ids.py)."""

from __future__ import annotations

import pytest

from slipstream.data.token_ids import check_ids_in_vocab


class CallerError(ValueError):
    pass


def test_the_first_sample_beyond_the_vocabulary_is_named_in_the_callers_error():
    check_ids_in_vocab([{"input_ids": [0, 99]}, {"input_ids": []}], 100, "rows.jsonl")  # every id fits
    samples = [{"input_ids": [1]}, {"input_ids": [5, 120]}, {"input_ids": [200]}]
    with pytest.raises(ValueError) as plain:
        check_ids_in_vocab(samples, 100, "rows.jsonl")
    assert str(plain.value) == (
        "rows.jsonl: sample 1 has token id 120, beyond the model's 100 embeddings: "
        "the tokenizer does not belong to this model"
    )
    with pytest.raises(CallerError, match=r"sample 1 has token id 120, .* this model \(resize\)$"):
        check_ids_in_vocab(samples, 100, "rows.jsonl", error=CallerError, advice=" (resize)")
