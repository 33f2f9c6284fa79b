"""A dataset file to training samples in one call, with a report of what was left out."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .errors import BadRowPolicy, DataError, DataReport, check_bad_row_policy
from .readers import read_rows
from .shapes import tokenize_row


def load_samples(
    path: str | Path, tokenizer: Any, response_only: bool = False, on_bad_row: BadRowPolicy = "error"
) -> tuple[list[dict[str, list[int]]], DataReport]:
    """Read and tokenize every row of ``path``: ``([{"input_ids", "labels"}, ...], report)``.

    With ``on_bad_row="skip"`` a row that cannot be read or tokenized is recorded in the
    report instead of stopping the load; a file with no usable row still raises.
    """
    check_bad_row_policy(on_bad_row)
    report = DataReport()
    samples = []
    for record, location in read_rows(path, on_bad_row, report):
        try:
            samples.append(tokenize_row(record, tokenizer, response_only, location))
        except DataError as error:
            if on_bad_row == "error":
                raise
            report.skip(error.location, error.reason)
    report.rows_used = len(samples)
    if not samples:
        raise DataError(str(path), f"no usable rows ({report.rows_read} read, {len(report.skipped)} skipped)")
    return samples, report
