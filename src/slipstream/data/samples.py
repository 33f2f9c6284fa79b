"""A dataset file to training samples in one call, with a report of what was left out.

Rows are checked and rendered one by one (a bad row names its location), then tokenized in
batches, the fast tokenizer's batch encoding running on every core. The result is cached
under ``$SLIPSTREAM_CACHE/tokenized/`` (default ``~/.cache/slipstream``), keyed by the data
file's bytes, the tokenizer (vocabulary, special tokens, chat template), the options and the
version of this code, so a second run with the same inputs reads it back in a fraction of
the time; any change to one of them builds a new entry.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import json
from pathlib import Path
from typing import Any

from ..atomic import atomic_directory
from .cache import cache_root
from .errors import BadRowPolicy, DataError, DataReport, check_bad_row_policy
from .readers import read_rows
from .shapes import RowPlan, plan_row, tokenize_planned

BATCH_ROWS = 512
# Bump when the rows -> samples logic changes in a way the key cannot see.
TOKENIZATION_VERSION = 3


def load_samples(
    path: str | Path,
    tokenizer: Any,
    response_only: bool = False,
    on_bad_row: BadRowPolicy = "error",
    cache: bool | str | Path = False,
) -> tuple[list[dict[str, list[int]]], DataReport]:
    """Read and tokenize every row of ``path``: ``([{"input_ids", "labels"}, ...], report)``.

    With ``on_bad_row="skip"`` a row that cannot be read or tokenized is recorded in the
    report instead of stopping the load; a file with no usable row still raises.
    ``cache``: ``True`` for the default cache folder, or a folder; ``False`` to always tokenize.
    """
    check_bad_row_policy(on_bad_row)
    with _collector_paused():
        return _load(path, tokenizer, response_only, on_bad_row, cache)


@contextlib.contextmanager
def _collector_paused():
    """Millions of new int lists make Python's cycle collector rescan everything again and again
    (a load of 100k rows took twice as long); they hold no cycles, so it waits until the end."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _load(path, tokenizer, response_only, on_bad_row, cache):
    entry = _cache_entry(path, tokenizer, response_only, on_bad_row, cache) if cache else None
    if entry is not None and (entry / "samples.parquet").exists():
        return _read_cache(entry)
    report = DataReport()
    samples: list[dict[str, list[int]]] = []
    plans: list[RowPlan] = []

    def flush() -> None:
        for result in tokenize_planned(plans, tokenizer):
            if isinstance(result, DataError):
                report.reject(result, on_bad_row)
            else:
                samples.append(result)
        plans.clear()

    for record, location in read_rows(path, on_bad_row, report):
        try:
            plans.append(plan_row(record, tokenizer, response_only, location))
        except DataError as error:
            report.reject(error, on_bad_row)
        if len(plans) >= BATCH_ROWS:
            flush()
    flush()
    report.count_used(len(samples), path)
    if entry is not None:
        _write_cache(entry, samples, report)
    return samples, report


# ---- the tokenized cache ----


def tokenizer_parts(tokenizer: Any) -> dict[str, Any]:
    """Hashes of what decides a tokenizer's ids, part by part (so a change can be named): its
    vocabulary and merges, its chat template, its special tokens."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        vocabulary = backend.to_str()
    else:
        vocabulary = json.dumps(sorted(tokenizer.get_vocab().items(), key=lambda item: item[1]))
    template = getattr(tokenizer, "chat_template", None)
    return {
        "vocabulary": hashlib.sha256(vocabulary.encode()).hexdigest(),
        "chat template": hashlib.sha256(json.dumps(template, sort_keys=True).encode()).hexdigest(),
        "special tokens": sorted(map(str, getattr(tokenizer, "all_special_tokens", []))),
    }


def hash_path(path: str | Path) -> tuple[str, int]:
    """SHA-256 and size of a file's bytes, or of a directory's files (with their relative paths)."""
    digest, size = hashlib.sha256(), 0
    path = Path(path)
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    for file in files:
        if path.is_dir():
            digest.update(file.relative_to(path).as_posix().encode() + b"\0")
        with open(file, "rb") as stream:
            while block := stream.read(1 << 20):
                digest.update(block)
                size += len(block)
    return digest.hexdigest(), size


def _cache_entry(path, tokenizer, response_only, on_bad_row, cache) -> Path | None:
    if not Path(path).exists():
        return None  # read_rows names the missing file
    key = {
        "data": hash_path(path)[0],
        "tokenizer": tokenizer_parts(tokenizer),
        "response_only": response_only,
        "on_bad_row": on_bad_row,
        "version": TOKENIZATION_VERSION,
    }
    name = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]
    return (cache_root() / "tokenized" if cache is True else Path(cache)) / name


def _write_cache(entry: Path, samples: list[dict[str, list[int]]], report: DataReport) -> None:
    """Written beside its final name and renamed, so a reader never sees half an entry."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table(
        {k: pa.array([s[k] for s in samples], type=pa.list_(pa.int32())) for k in ("input_ids", "labels")}
    )
    stored = {"rows_read": report.rows_read, "rows_used": report.rows_used, "skipped": report.skipped}
    # another process may write the same entry first: theirs is as good
    with atomic_directory(entry, existing="keep") as tmp:
        pq.write_table(table, tmp / "samples.parquet")
        (tmp / "report.json").write_text(json.dumps(stored))


def _read_cache(entry: Path) -> tuple[list[dict[str, list[int]]], DataReport]:
    import pyarrow.parquet as pq

    table = pq.read_table(entry / "samples.parquet")
    columns = (table.column(name).to_pylist() for name in ("input_ids", "labels"))
    samples = [{"input_ids": ids, "labels": labels} for ids, labels in zip(*columns, strict=True)]
    stored = json.loads((entry / "report.json").read_text())
    report = DataReport(rows_read=stored["rows_read"], rows_used=stored["rows_used"])
    report.skipped = [tuple(item) for item in stored["skipped"]]
    report.cached = str(entry)
    return samples, report
