"""Where slipstream keeps what it builds or derives: ``$SLIPSTREAM_CACHE``, default ``~/.cache/slipstream``."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """The slipstream cache directory (the demo tokenizer, tokenized datasets, doctor's markers).

    Read at call time, so a test or a user can point ``SLIPSTREAM_CACHE`` elsewhere."""
    return Path(os.environ.get("SLIPSTREAM_CACHE") or Path.home() / ".cache" / "slipstream")
