"""read_rows: every format, and bad rows named by file and line (or row)."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from slipstream.data import DataError, DataReport, read_rows

ROWS = [
    {"text": "one"},
    {"instruction": "two", "output": "2"},
    {"messages": [{"role": "user", "content": "3"}]},
]


def write_jsonl(path, lines):
    path.write_bytes(b"".join(line if isinstance(line, bytes) else line.encode() + b"\n" for line in lines))
    return path


def json_array_with_lines(rows):
    """A pretty-printed JSON array, and the 1-based line each element starts on."""
    text, starts = "[\n", []
    for index, row in enumerate(rows):
        starts.append(text.count("\n") + 1)
        element = row if isinstance(row, str) else json.dumps(row, indent=2)
        text += element + (",\n" if index < len(rows) - 1 else "\n")
    return text + "]\n", starts


def test_jsonl_rows_with_lines_blank_lines_and_bom(tmp_path):
    path = write_jsonl(
        tmp_path / "d.jsonl",
        [b"\xef\xbb\xbf" + json.dumps(ROWS[0]).encode() + b"\n", "", "  "]
        + [json.dumps(row) for row in ROWS[1:]],
    )
    got = list(read_rows(path))
    assert [record for record, _ in got] == ROWS
    assert [location for _, location in got] == [f"{path}:1", f"{path}:4", f"{path}:5"]


def test_json_array_names_each_elements_start_line(tmp_path):
    text, starts = json_array_with_lines(ROWS)
    (tmp_path / "d.json").write_text(text)
    got = list(read_rows(tmp_path / "d.json"))
    assert [record for record, _ in got] == ROWS
    assert [location for _, location in got] == [f"{tmp_path / 'd.json'}:{line}" for line in starts]
    assert starts[1] > 2  # the elements really span several lines


def test_json_object_holding_one_list(tmp_path):
    path = tmp_path / "d.json"
    path.write_text(
        '{"version": 2, "meta": {"a": 1},\n "data": [\n' + ",\n".join(map(json.dumps, ROWS)) + "]}"
    )
    got = list(read_rows(path))
    assert [record for record, _ in got] == ROWS
    assert [location for _, location in got] == [f"{path}:3", f"{path}:4", f"{path}:5"]


@pytest.mark.parametrize(
    "text, reason",
    [
        ('{"a": [], "b": []}', "exactly one list"),
        ('{"a": 1}', "exactly one list"),
        ("42", "expected a JSON array"),
        ("", "empty file"),
        ("[]\n[]", "extra data"),
    ],
)
def test_json_with_no_single_list_of_rows(tmp_path, text, reason):
    (tmp_path / "d.json").write_text(text)
    with pytest.raises(DataError, match=reason):
        read_rows(tmp_path / "d.json")


def test_json_broken_mid_array_names_the_line_even_when_skipping(tmp_path):
    text, starts = json_array_with_lines([ROWS[0], '{"text": "x",\n  oops}', ROWS[1]])
    (tmp_path / "d.json").write_text(text)
    with pytest.raises(DataError, match=rf"d\.json:{starts[1] + 1}: invalid JSON"):
        read_rows(tmp_path / "d.json", on_bad_row="skip")


def test_json_not_utf8_names_the_line(tmp_path):
    (tmp_path / "d.json").write_bytes(b'[\n{"text": "a"},\n{"text": "caf\xe9"}\n]')
    with pytest.raises(DataError, match=r"d\.json:3: not valid UTF-8"):
        read_rows(tmp_path / "d.json")


def test_parquet_rows_with_nested_messages(tmp_path):
    path = tmp_path / "rows.parquet"
    rows = [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}] * 3
    pq.write_table(pa.Table.from_pylist(rows), path)
    got = list(read_rows(path))
    assert [record for record, _ in got] == rows
    assert [location for _, location in got] == [f"{path}: row {index}" for index in range(3)]


def test_datasets_directory_and_dataset_dict(tmp_path):
    datasets = pytest.importorskip(
        "datasets", reason="datasets is not installed (pip install 'slipstream[datasets]')"
    )
    datasets.Dataset.from_list(ROWS[:1] * 4).save_to_disk(str(tmp_path / "single"))
    assert [loc for _, loc in read_rows(tmp_path / "single")][-1] == f"{tmp_path / 'single'}: row 3"

    splits = datasets.DatasetDict(
        train=datasets.Dataset.from_list(ROWS[:1] * 2), test=datasets.Dataset.from_list(ROWS[:1])
    )
    splits.save_to_disk(str(tmp_path / "splits"))
    assert len(list(read_rows(tmp_path / "splits"))) == 2

    datasets.DatasetDict(test=datasets.Dataset.from_list(ROWS[:1])).save_to_disk(str(tmp_path / "no_train"))
    with pytest.raises(DataError, match="no 'train' split"):
        read_rows(tmp_path / "no_train")


def test_whole_file_problems_name_the_path(tmp_path):
    (tmp_path / "d.csv").write_text("a,b\n")
    with pytest.raises(DataError, match=r"d\.csv: unknown format '\.csv'"):
        read_rows(tmp_path / "d.csv")
    with pytest.raises(DataError, match=r"missing\.jsonl: no such file"):
        read_rows(tmp_path / "missing.jsonl")
    (tmp_path / "bad.parquet").write_text("not parquet")
    with pytest.raises(DataError, match=r"bad\.parquet: not a readable Parquet file"):
        read_rows(tmp_path / "bad.parquet")
    (tmp_path / "empty_dir").mkdir()
    with pytest.raises(DataError, match="empty_dir: not a directory saved with datasets"):
        read_rows(tmp_path / "empty_dir")


def test_bad_on_bad_row_value_is_named_at_the_call(tmp_path):
    with pytest.raises(ValueError, match="on_bad_row='ignore'"):
        read_rows(tmp_path / "whatever.jsonl", on_bad_row="ignore")


BAD_JSONL_LINES = [
    (b'{"text": "caf\xe9"}\n', "not valid UTF-8"),
    (b'{"text": "a",}\n', "invalid JSON"),
    (b"[1, 2]\n", "expected a JSON object, got array"),
    (b'"just a string"\n', "expected a JSON object, got string"),
]


@pytest.mark.parametrize("line, reason", BAD_JSONL_LINES)
def test_unreadable_jsonl_line_raises_with_its_line(tmp_path, line, reason):
    path = write_jsonl(tmp_path / "d.jsonl", ['{"text": "a"}', "", line, '{"text": "b"}'])
    with pytest.raises(DataError, match=rf"d\.jsonl:3: {reason}"):
        list(read_rows(path))


def test_skip_mode_counts_and_records(tmp_path):
    lines = ['{"text": "a"}'] + [line for line, _ in BAD_JSONL_LINES] + ['{"text": "b"}']
    path = write_jsonl(tmp_path / "d.jsonl", lines)
    report = DataReport()
    got = list(read_rows(path, on_bad_row="skip", report=report))
    assert [location for _, location in got] == [f"{path}:1", f"{path}:6"]
    assert report.rows_read == 6
    assert [location for location, _ in report.skipped] == [f"{path}:{line}" for line in range(2, 6)]
    for (_, reason), (_, expected) in zip(report.skipped, BAD_JSONL_LINES, strict=True):
        assert reason.startswith(expected)
