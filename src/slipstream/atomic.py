"""Nothing half-written: every file or directory slipstream produces is written under a
temporary name beside its destination and renamed into place once complete.

Temporary names are hidden siblings ending ``.tmp-PID`` (files keep their suffix after it,
directories get a random one), and a directory being replaced or discarded is first renamed
to ``.NAME.old-PID.XXXX``: what an interrupted write leaves is recognisable by name (see
``train/output_dir.py``) and never mistaken for the real thing.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

Existing = Literal["replace", "keep", "refuse"]


@contextlib.contextmanager
def atomic_file(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path to write ``path`` through: renamed over it on success, removed on failure."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.stem}.tmp-{os.getpid()}{path.suffix}")  # the suffix kept: plots need it
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_text_atomically(path: str | os.PathLike, text: str) -> None:
    with atomic_file(path) as tmp:
        tmp.write_text(text)


def _sibling(path: Path, kind: str) -> Path:
    # Random beyond the PID: two threads of one process never share a temporary directory.
    return path.with_name(f".{path.name}.{kind}-{os.getpid()}.{secrets.token_hex(4)}")


def discard_directory(path: str | os.PathLike) -> None:
    """Rename ``path`` aside, then delete it: it vanishes at once, whatever happens next."""
    aside = _sibling(Path(path), "old")
    os.replace(path, aside)
    if aside.is_dir() and not aside.is_symlink():
        shutil.rmtree(aside, ignore_errors=True)
    else:
        aside.unlink(missing_ok=True)


@contextlib.contextmanager
def atomic_directory(path: str | os.PathLike, *, existing: Existing = "replace") -> Iterator[Path]:
    """Yield an empty temporary sibling directory to fill; renamed to ``path`` on success, removed on failure.

    If ``path`` exists by then, ``existing`` says what wins: "replace" discards the old one
    (a reader sees the old or the new, never half of either), "keep" keeps it and drops ours
    (a concurrent writer of the same thing got there first), "refuse" raises ``FileExistsError``.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _sibling(path, "tmp")
    tmp.mkdir()
    try:
        yield tmp
        if path.exists():
            if existing == "refuse":
                raise FileExistsError(f"{path} exists; not overwriting it")
            if existing == "replace":
                discard_directory(path)
        try:
            os.replace(tmp, path)
        except OSError:
            if existing != "keep" or not path.exists():
                raise
            shutil.rmtree(tmp, ignore_errors=True)  # another writer's copy landed first: keep it
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
