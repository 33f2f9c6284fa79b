"""load_samples: batched tokenization equals row-by-row, and the tokenized cache is keyed by everything."""

from __future__ import annotations

import json

from slipstream.data import load_samples, tokenize_row


def write_rows(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


CHATS = [
    {
        "messages": [
            {"role": "user", "content": f"Add {i} and {i + 1}"},
            {"role": "assistant", "content": f"{2 * i + 1}"},
        ]
    }
    for i in range(40)
] + [{"text": "plain text row"}, {"messages": "not a list"}]


def test_batched_load_equals_row_by_row_and_reports_skips(tmp_path, tokenizer):
    data = tmp_path / "rows.jsonl"
    write_rows(data, CHATS)
    samples, report = load_samples(data, tokenizer, response_only=True, on_bad_row="skip")
    expected = [tokenize_row(row, tokenizer, response_only=True) for row in CHATS[:-1]]
    assert samples == expected
    assert (report.rows_read, report.rows_used, len(report.skipped)) == (42, 41, 1)
    assert report.to_dict()["skip_reasons"] == {
        "'messages' must be a list of {role, content} objects, got string": 1
    }


def test_a_second_load_reads_the_cache_and_any_change_misses_it(tmp_path, tokenizer, plain_tokenizer):
    data, cache = tmp_path / "rows.jsonl", tmp_path / "cache"
    write_rows(data, CHATS[:-1])
    first, report = load_samples(data, tokenizer, response_only=True, cache=cache)
    assert report.cached is None and len(list(cache.iterdir())) == 1
    again, report = load_samples(data, tokenizer, response_only=True, cache=cache)
    assert report.cached is not None and again == first
    assert report.rows_used == len(first)
    load_samples(data, tokenizer, response_only=False, cache=cache)  # another option
    plain_tokenizer.chat_template = tokenizer.chat_template.replace("<|im_end|>\n", "<|im_end|>\n\n")
    load_samples(data, plain_tokenizer, response_only=True, cache=cache)  # another template
    write_rows(data, CHATS[:-2])  # another file content
    changed, report = load_samples(data, tokenizer, response_only=True, cache=cache)
    assert report.cached is None and len(changed) == len(first) - 1
    assert len([p for p in cache.iterdir() if not p.name.startswith(".")]) == 4
