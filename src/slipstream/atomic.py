"""Nothing half-written: every file or directory slipstream produces is written under a
temporary name beside its destination and renamed into place once complete."""

from __future__ import annotations

import os
from pathlib import Path


def temporary_path(path: Path) -> Path:
    """A hidden sibling of ``path`` unique to this process, keeping its suffix (plots need it)."""
    return path.with_name(f".{path.stem}.tmp-{os.getpid()}{path.suffix}")


def write_text_atomically(path: Path, text: str) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temporary_path(path)
    tmp.write_text(text)
    os.replace(tmp, path)
