"""load_samples: bad rows of every kind named by file and line, and skip mode's report."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from slipstream.data import DataError, load_samples

from .test_readers import json_array_with_lines, write_jsonl
from .test_shapes import BAD_ROWS

GOOD = [
    {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]},
    {"instruction": "Add", "input": "1+2", "output": "3"},
    {"text": "apple river"},
]


@pytest.mark.parametrize("record, reason", BAD_ROWS)
def test_bad_jsonl_row_names_file_and_line(tmp_path, tokenizer, record, reason):
    path = write_jsonl(tmp_path / "data.jsonl", [json.dumps(row) for row in GOOD] + ["", json.dumps(record)])
    with pytest.raises(DataError, match=rf"^{path}:5: {reason}"):
        load_samples(path, tokenizer, response_only=True)


@pytest.mark.parametrize("record, reason", [*BAD_ROWS, ([1], "expected a JSON object, got array")])
def test_bad_json_array_element_names_its_start_line(tmp_path, tokenizer, record, reason):
    text, starts = json_array_with_lines([*GOOD, record, GOOD[0]])
    (tmp_path / "train.json").write_text(text)
    with pytest.raises(DataError, match=rf"^{tmp_path / 'train.json'}:{starts[3]}: {reason}"):
        load_samples(tmp_path / "train.json", tokenizer, response_only=True)


def test_parquet_row_with_a_null_names_the_row(tmp_path, tokenizer):
    path = tmp_path / "rows.parquet"
    pq.write_table(pa.Table.from_pylist([{"text": "a"}, {"text": "b"}, {"text": None}]), path)
    with pytest.raises(DataError, match=rf"^{path}: row 2: missing field 'text'"):
        load_samples(path, tokenizer)


def test_skip_mode_keeps_good_rows_and_reports_the_rest(tmp_path, tokenizer):
    bad = [record for record, _ in BAD_ROWS]
    lines = (
        [json.dumps(row) for row in GOOD] + [json.dumps(row) for row in bad] + [b'{"text": "\xff"}\n', "{"]
    )
    path = write_jsonl(tmp_path / "data.jsonl", lines)
    samples, report = load_samples(path, tokenizer, response_only=True, on_bad_row="skip")
    assert len(samples) == report.rows_used == len(GOOD)
    assert report.rows_read == len(lines)
    assert [location for location, _ in report.skipped] == [f"{path}:{n}" for n in range(4, len(lines) + 1)]
    assert [reason for _, reason in report.skipped][-2:] == [
        "not valid UTF-8 (byte 11 of the line)",
        "invalid JSON (Expecting property name enclosed in double quotes at column 2)",
    ]
    summary = report.summary()
    assert summary.startswith(f"rows: {len(lines)} read, 3 used, {len(lines) - 3} skipped")
    assert f"skipped {path}:4: missing field" in summary and "more" in summary


def test_every_row_bad_still_raises_in_skip_mode(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "data.jsonl", ['{"text": ""}'])
    with pytest.raises(DataError, match=r"no usable rows \(1 read, 1 skipped\)"):
        load_samples(path, tokenizer, on_bad_row="skip")


def test_bad_policy_is_a_value_error(tmp_path, tokenizer):
    with pytest.raises(ValueError, match="on_bad_row='warn'"):
        load_samples(tmp_path / "x.jsonl", tokenizer, on_bad_row="warn")
