"""Which output directories a run may use, and what ``--overwrite`` may delete.

A run marks its output directory with ``.slipstream-run`` (JSON: format version, creation
time, slipstream version) before it writes anything else. The rules:

- a new or empty directory is used and marked;
- a directory slipstream did not mark (no ``.slipstream-run``) and that is not empty is never
  used and never deleted, with or without ``--overwrite``; a file is refused as well;
- a marked directory holding a finished run (``run.json``) needs ``--overwrite``; one holding
  an unfinished run needs ``--resume`` (continue) or ``--overwrite`` (start over);
- ``--overwrite`` deletes only the entries slipstream writes there (``adapter/``,
  ``checkpoints/``, ``metrics.jsonl``, ``samples.jsonl``, ``run.json``, ``config.json``,
  ``tensorboard/``, the marker and temporary leftovers) and keeps anything else, naming it in a warning;
- the temporary files and folders a killed run leaves (``.step-*.tmp-*`` checkpoints caught
  mid-write, ``.adapter.tmp-*``, ``.run.tmp-*.json`` ...) are removed when a run starts or resumes.

A run whose set-up fails (a bad data line, a missing model: anything before the first step) leaves
nothing behind (``NewOutput``): a directory it created is removed, and one that was empty is left
empty; a directory that held something keeps it.

A directory written by a slipstream from before the marker (it has ``checkpoints/`` but no
marker) may still be resumed; it is marked then. One live run at a time: the caller holds the
directory's lock (``lock.py``) before calling ``prepare_output``, which ignores the lock file.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from .._version import __version__
from ..atomic import write_text_atomically
from .errors import TrainError
from .lock import LOCK

logger = logging.getLogger("slipstream")

MARKER = ".slipstream-run"
MARKER_FORMAT = 1
FINISHED = "run.json"
CHECKPOINTS = "checkpoints"
METRICS = "metrics.jsonl"
SAMPLES = "samples.jsonl"  # training.sample_prompts' answers
CONFIG = "config.json"
ADAPTER = "adapter"
TENSORBOARD = "tensorboard"
OWN_ENTRIES = frozenset({MARKER, ADAPTER, CHECKPOINTS, METRICS, SAMPLES, FINISHED, CONFIG, TENSORBOARD})

# What an interrupted write leaves (see ``atomic``): files (".run.tmp-123.json"), the adapter
# (".adapter.tmp-123.9f3a0c2e") and checkpoints (".step-000008.tmp-123.9f3a0c2e", and
# ".step-000004.old-123.5b1d7e40" for one being replaced or pruned).
_LEFTOVER = re.compile(r"^\..+\.(tmp|old)-\d+(\.[A-Za-z0-9]+)?$")


def is_leftover(name: str) -> bool:
    """Whether ``name`` is a temporary file or folder of an interrupted slipstream write."""
    return bool(_LEFTOVER.match(name))


def write_marker(out: Path) -> None:
    marker = {
        "format": MARKER_FORMAT,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "slipstream": __version__,
    }
    write_text_atomically(Path(out) / MARKER, json.dumps(marker, indent=1) + "\n")


def _remove(path: Path) -> None:
    try:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()
    except FileNotFoundError:
        pass
    except OSError as error:
        raise TrainError(f"{path}: cannot remove it ({error.strerror or error})") from None


def remove_leftovers(out: Path) -> None:
    """Delete the temporary files and folders of interrupted writes in ``out`` and its checkpoints."""
    removed = []
    for folder in (Path(out), Path(out) / CHECKPOINTS):
        if not folder.is_dir():
            continue
        for entry in sorted(folder.iterdir()):
            if is_leftover(entry.name):
                _remove(entry)
                removed.append(str(entry))
    if removed:
        logger.info("removed %d leftover(s) of an interrupted write: %s", len(removed), ", ".join(removed))


def _clear(out: Path, entries: list[str], overwrite: bool) -> None:
    """Delete what slipstream wrote in ``out`` (never anything else); warn about what stays."""
    kept = []
    for name in entries:
        if name in OWN_ENTRIES or is_leftover(name):
            _remove(out / name)
        else:
            kept.append(name)
    if kept and overwrite:
        logger.warning(
            "%s: --overwrite kept %d entr%s slipstream did not write: %s",
            out,
            len(kept),
            "y" if len(kept) == 1 else "ies",
            ", ".join(kept),
        )


@dataclass(frozen=True)
class NewOutput:
    """An output directory a run starts from nothing (absent, or empty): what a failed set-up undoes."""

    out: Path
    created: Path | None  # the outermost directory the run creates (``out`` or a parent); None: out was empty

    @classmethod
    def of(cls, out: Path) -> NewOutput | None:
        """``out`` before the run touches it; None where it holds something (or cannot be read)."""
        out = Path(out)
        try:
            if out.is_dir():
                return None if any(out.iterdir()) else cls(out, None)
        except OSError:
            return None
        if out.exists() or out.is_symlink():  # a file, or a dangling link: refused, never removed
            return None
        top = out
        while top.parent != top and not top.parent.exists():
            top = top.parent
        return cls(out, top)

    def undo(self, lock) -> None:
        """Remove what the failed set-up wrote in ``out`` (slipstream's own entries only) while ``lock``
        (``lock.RunLock``, which this releases) still holds it, then the directories it created, if empty."""
        with contextlib.suppress(OSError, TrainError):  # the set-up's own error is the one to say
            for entry in self.out.iterdir():
                if entry.name in OWN_ENTRIES or is_leftover(entry.name):
                    _remove(entry)
        lock.release()
        for folder in (self.out, *self.out.parents) if self.created is not None else ():
            try:
                folder.rmdir()
            except OSError:  # not empty: another run took it meanwhile
                return
            if folder == self.created:
                return


def rewind_metrics(out: Path, step: int, name: str = METRICS) -> list[dict]:
    """Keep the records of ``metrics.jsonl`` (or ``name``, another JSON-lines file of records with a
    ``step``) up to ``step`` (a resumed run redoes the rest); 0 deletes it."""
    path = Path(out) / name
    if step == 0:
        path.unlink(missing_ok=True)
        return []
    lines = path.read_text().splitlines() if path.exists() else []
    kept = [(line, record) for line in lines if (record := json.loads(line))["step"] <= step]
    write_text_atomically(path, "".join(line + "\n" for line, _ in kept))
    return [record for _, record in kept]


def prepare_output(out: Path, *, resume: bool, overwrite: bool) -> bool:
    """Check ``out`` against the rules above, clear or clean it, create and mark it.

    Returns whether there is a run to resume in it (``resume`` was asked and the directory
    holds one); raises ``TrainError`` (one line, naming the directory) otherwise.
    """
    out = Path(out)
    if resume and overwrite:
        raise TrainError(
            f"{out}: --resume and --overwrite contradict each other "
            "(--resume continues the run there, --overwrite starts it over): pass one"
        )
    if out.exists() and not out.is_dir():
        raise TrainError(f"{out}: output_dir is a file, not a directory")
    try:
        # the run lock (``lock.py``) is taken before this looks: it is the caller's, not the run's
        entries = sorted(entry.name for entry in out.iterdir() if entry.name != LOCK) if out.exists() else []
    except OSError as error:
        raise TrainError(f"{out}: cannot list the output directory ({error.strerror or error})") from None
    marked = MARKER in entries and (out / MARKER).is_file()
    older_run = not marked and (out / CHECKPOINTS).is_dir()  # a run from before the marker
    if entries and not marked:
        if resume and older_run:
            if (out / FINISHED).exists():
                raise TrainError(f"{out} already holds a finished run ({FINISHED}); nothing to resume")
            logger.warning("%s: a run from an older slipstream (no %s marker): marking it", out, MARKER)
            remove_leftovers(out)
            write_marker(out)
            return True
        if older_run:
            why = f"holds a run from an older slipstream, which did not mark its runs (no {MARKER})"
        else:
            why = f"is not empty and slipstream did not mark it as its own run (no {MARKER})"
        if overwrite:
            raise TrainError(f"{out}: --overwrite refused: the directory {why}; nothing was deleted")
        if resume:
            raise TrainError(f"{out}: nothing to resume: the directory {why}")
        raise TrainError(f"{out}: the directory {why}: choose a new or empty output_dir")
    finished = (out / FINISHED).exists()
    if marked and not overwrite:
        if finished:
            if resume:
                raise TrainError(
                    f"{out} already holds a finished run ({FINISHED}); nothing to resume "
                    "(pass --overwrite to start it over)"
                )
            raise TrainError(
                f"{out} already holds a finished run ({FINISHED}); pass --overwrite to replace it"
            )
        if resume:
            remove_leftovers(out)
            return True
        if any(name in OWN_ENTRIES and name not in (MARKER, CONFIG) for name in entries):
            raise TrainError(
                f"{out} holds an unfinished run: pass --resume to continue it or --overwrite to start over"
            )
    if marked:
        _clear(out, entries, overwrite)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise TrainError(f"{out}: cannot create the output directory ({error.strerror or error})") from None
    write_marker(out)
    return False
