"""Reading datasets into training samples: rows → tokens → bins.

- ``read_rows``: ``(record, location)`` from JSONL, JSON, Parquet or a datasets-on-disk folder.
- ``tokenize_row``: a chat, Alpaca or plain-text row to ``{"input_ids", "labels"}``, with
  response-only labels found from the chat template itself.
- ``load_samples``: both of the above over a file, with a ``DataReport`` of skipped rows.
- ``pack_samples``: best-fit-decreasing bin packing, with a ``PackingReport``.
- ``demo_rows`` / ``demo_tokenizer`` / ``demo_samples``: built-in data a small model can
  learn from, and a tokenizer trained on it; nothing is downloaded.
- ``cache_root``: ``$SLIPSTREAM_CACHE`` (default ``~/.cache/slipstream``), where all of it is kept.

Every problem with the data is a ``DataError`` whose message starts with its location.
"""

from .binpack import PackingReport, pack_samples
from .cache import cache_root
from .demo_bpe import demo_samples, demo_tokenizer
from .demo_data import demo_rows
from .errors import DataError, DataReport
from .readers import read_rows
from .samples import load_samples
from .shapes import tokenize_row

__all__ = [
    "DataError",
    "DataReport",
    "PackingReport",
    "cache_root",
    "demo_rows",
    "demo_samples",
    "demo_tokenizer",
    "load_samples",
    "pack_samples",
    "read_rows",
    "tokenize_row",
]
