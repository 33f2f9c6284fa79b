"""Rows from files: JSONL, JSON, Parquet and datasets-on-disk, each row with where it came from.

``read_rows`` yields ``(record, location)``. The location is ``"file.jsonl:3"`` (1-based
line, as an editor shows it) for JSON text, and ``"file.parquet: row 3"`` (0-based, as in
``ds[3]``) for columnar data. A row that cannot be read (bad JSON, bad UTF-8, not an object)
raises a ``DataError`` at that location, or with ``on_bad_row="skip"`` is counted in the
report and left out. A problem with the file as a whole (missing, unknown format, a JSON
array broken in the middle) always raises.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import BadRowPolicy, DataError, DataReport, check_bad_row_policy, json_type

FORMATS = ".jsonl, .json, .parquet or a directory saved with datasets' save_to_disk"
_JSON_WHITESPACE = " \t\n\r"


@dataclass(frozen=True)
class _BadRow:
    """A row a reader could not turn into a value; the reason goes to the error or the report."""

    reason: str


def read_rows(
    path: str | Path, on_bad_row: BadRowPolicy = "error", report: DataReport | None = None
) -> Iterator[tuple[dict[str, Any], str]]:
    """``(record, location)`` for every row of ``path``; see the module docstring.

    The policy and the file's existence and format are checked at the call, not at the first row.
    """
    check_bad_row_policy(on_bad_row)
    values = _values(Path(path))
    return _records(values, on_bad_row, report if report is not None else DataReport())


def _records(
    values: Iterator[tuple[Any, str]], on_bad_row: BadRowPolicy, report: DataReport
) -> Iterator[tuple[dict[str, Any], str]]:
    for value, location in values:
        report.rows_read += 1
        if isinstance(value, dict):
            yield value, location
            continue
        reason = (
            value.reason if isinstance(value, _BadRow) else f"expected a JSON object, got {json_type(value)}"
        )
        report.reject(DataError(location, reason), on_bad_row)


def _values(path: Path) -> Iterator[tuple[Any, str]]:
    if not path.exists():
        raise DataError(str(path), "no such file or directory")
    if path.is_dir():
        return _dataset_dir_rows(path)
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".ndjson"):
        return _jsonl_rows(path)
    if suffix == ".json":
        return _json_rows(path)
    if suffix == ".parquet":
        return _parquet_rows(path)
    raise DataError(str(path), f"unknown format {suffix or '(no suffix)'!r}: expected {FORMATS}")


# ---- JSON Lines: one value per line, read as bytes so a bad byte names its line ----


def _jsonl_rows(path: Path) -> Iterator[tuple[Any, str]]:
    with open(path, "rb") as lines:
        for line_number, line in enumerate(lines, start=1):
            location = f"{path}:{line_number}"
            if line_number == 1:
                line = line.removeprefix(b"\xef\xbb\xbf")  # a UTF-8 byte-order mark
            if not line.strip():
                continue
            try:
                text = line.decode("utf-8").rstrip("\r\n")  # so error columns count within the line
            except UnicodeDecodeError as error:
                yield _BadRow(f"not valid UTF-8 (byte {error.start + 1} of the line)"), location
                continue
            try:
                yield json.loads(text), location
            except json.JSONDecodeError as error:
                yield _BadRow(f"invalid JSON ({error.msg} at column {error.colno})"), location


# ---- JSON: an array of objects (or one object holding one list), element by element ----


def _json_rows(path: Path) -> Iterator[tuple[Any, str]]:
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as error:
        line = raw.count(b"\n", 0, error.start) + 1
        raise DataError(f"{path}:{line}", "not valid UTF-8") from None
    elements = _JsonScanner(text, str(path)).top_level_list()
    return _with_line_numbers(elements, text, path)


def _with_line_numbers(elements: list[tuple[Any, int]], text: str, path: Path) -> Iterator[tuple[Any, str]]:
    line, counted_to = 1, 0
    for value, offset in elements:  # offsets ascend, so count newlines incrementally
        line += text.count("\n", counted_to, offset)
        counted_to = offset
        yield value, f"{path}:{line}"


class _JsonScanner:
    """Walks a JSON document with ``raw_decode`` to learn where each list element starts."""

    def __init__(self, text: str, name: str):
        self.text, self.name = text, name
        self.decoder = json.JSONDecoder()

    def top_level_list(self) -> list[tuple[Any, int]]:
        pos = self._skip_whitespace(0)
        if pos == len(self.text):
            raise DataError(self.name, "empty file: expected a JSON array of objects")
        if self.text[pos] == "[":
            elements, pos = self._array(pos)
        elif self.text[pos] == "{":
            elements, pos = self._only_list_in_object(pos)
        else:
            raise self._error(pos, "expected a JSON array of objects, or an object holding one list")
        if self._skip_whitespace(pos) != len(self.text):
            raise self._error(self._skip_whitespace(pos), "extra data after the top-level JSON value")
        return elements

    def _array(self, pos: int) -> tuple[list[tuple[Any, int]], int]:
        """Elements with their start offsets, and the offset just past the closing bracket."""
        elements: list[tuple[Any, int]] = []
        pos = self._skip_whitespace(pos + 1)
        if self._char(pos) == "]":
            return elements, pos + 1
        while True:
            value, end = self._decode(pos)
            elements.append((value, pos))
            pos = self._skip_whitespace(end)
            if self._char(pos) == "]":
                return elements, pos + 1
            if self._char(pos) != ",":
                raise self._error(pos, "invalid JSON (expected ',' or ']' after an array element)")
            pos = self._skip_whitespace(pos + 1)

    def _only_list_in_object(self, pos: int) -> tuple[list[tuple[Any, int]], int]:
        """The elements of the one list-valued key of a top-level object, e.g. ``{"data": [...]}``."""
        lists: dict[str, list[tuple[Any, int]]] = {}
        pos = self._skip_whitespace(pos + 1)
        while self._char(pos) != "}":
            key, pos = self._decode(pos)
            pos = self._skip_whitespace(pos)
            if not isinstance(key, str) or self._char(pos) != ":":
                raise self._error(pos, "invalid JSON (expected a string key and ':')")
            pos = self._skip_whitespace(pos + 1)
            if self._char(pos) == "[":
                lists[key], pos = self._array(pos)
            else:
                _, pos = self._decode(pos)
            pos = self._skip_whitespace(pos)
            if self._char(pos) == ",":
                pos = self._skip_whitespace(pos + 1)
            elif self._char(pos) != "}":
                raise self._error(pos, "invalid JSON (expected ',' or '}' after an object member)")
        if len(lists) != 1:
            found = f"lists under {', '.join(map(repr, lists))}" if lists else "no list"
            raise DataError(
                self.name, f"the top-level object must hold exactly one list of rows; found {found}"
            )
        return next(iter(lists.values())), pos + 1

    def _decode(self, pos: int) -> tuple[Any, int]:
        try:
            return self.decoder.raw_decode(self.text, pos)
        except json.JSONDecodeError as error:  # its lineno counts from the start of the whole text
            raise DataError(
                f"{self.name}:{error.lineno}", f"invalid JSON ({error.msg} at column {error.colno})"
            ) from None

    def _char(self, pos: int) -> str:
        return self.text[pos] if pos < len(self.text) else ""

    def _skip_whitespace(self, pos: int) -> int:
        while pos < len(self.text) and self.text[pos] in _JSON_WHITESPACE:
            pos += 1
        return pos

    def _error(self, pos: int, reason: str) -> DataError:
        return DataError(f"{self.name}:{self.text.count(chr(10), 0, pos) + 1}", reason)


# ---- columnar: Parquet and datasets-on-disk, row by row ----


def _parquet_rows(path: Path) -> Iterator[tuple[Any, str]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as error:
        raise DataError(str(path), f"not a readable Parquet file ({error})") from None
    records = (record for batch in parquet.iter_batches(batch_size=1024) for record in batch.to_pylist())
    return ((record, f"{path}: row {index}") for index, record in enumerate(records))


def _dataset_dir_rows(path: Path) -> Iterator[tuple[Any, str]]:
    from ..extras import require

    datasets = require("datasets", f"{path}: reading a directory saved with datasets")

    try:
        loaded = datasets.load_from_disk(str(path))
    except (FileNotFoundError, ValueError) as error:
        raise DataError(str(path), f"not a directory saved with datasets' save_to_disk ({error})") from None
    if isinstance(loaded, datasets.DatasetDict):
        if "train" not in loaded:
            raise DataError(str(path), f"DatasetDict has no 'train' split (splits: {', '.join(loaded)})")
        loaded = loaded["train"]
    return ((record, f"{path}: row {index}") for index, record in enumerate(loaded))
