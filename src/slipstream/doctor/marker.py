"""Has doctor passed on this device? A small marker per device (name, torch version, CPU class) in the cache.

``slipstream doctor`` writes the marker after a run with no WRONG path; ``slipstream train`` and
``slipstream ab`` call :func:`first_use_hint`, which prints one line to stderr while there is
none. Nothing here may break a command: an unwritable or unreadable cache only loses the hint.

When the hint speaks (decided, and tested in tests/doctor/test_doctor.py):
- only to a person: stderr is a terminal and no ``CI`` variable is set. A script, a pipeline or
  CI reads exactly the command's own output, on a fresh machine as on a checked one;
- only once the command's arguments and config are valid: the commands call it after parsing,
  so a mistake is still the one line that names it.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, TextIO

import torch

from ..atomic import write_text_atomically
from ..data import cache_root
from ..hardware import device_identity
from .machine import training_device


def marker_key(device: torch.device | None = None) -> dict[str, str]:
    """The device doctor checked (``hardware.device_identity``: its name, torch's version and, on a
    CPU, its class and kernel caps: an overridden or capped CPU is checked on its own)."""
    return device_identity(device or training_device())


def marker_path(key: dict[str, str]) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return cache_root() / "doctor" / f"passed-{digest}.json"


def write_marker(key: dict[str, str], summary: dict[str, Any]) -> tuple[Path | None, str | None]:
    """Record a passing doctor run for ``key``; returns (path, None) or (None, why it could not)."""
    try:
        path = marker_path(key)
        record = {**key, "checked_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), **summary}
        write_text_atomically(path, json.dumps(record, indent=2) + "\n")
        return path, None
    except (OSError, RuntimeError) as error:  # RuntimeError: no home directory to find the cache in
        return None, f"{type(error).__name__}: {error}"


def has_passed(device: torch.device | None = None) -> bool:
    return marker_path(marker_key(device)).is_file()


def is_interactive(stream: TextIO) -> bool:
    """Whether a person reads ``stream``: a terminal, and no CI system (``CI`` set, not false)."""
    if os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no"):
        return False
    isatty = getattr(stream, "isatty", None)
    return bool(isatty is not None and isatty())


def first_use_hint(stream: TextIO | None = None) -> bool:
    """Print one line pointing at ``slipstream doctor`` if it never passed on this device; True if printed.

    Only to a person (:func:`is_interactive`), only rank 0 under torchrun; any failure (no
    cache, no device name) prints nothing."""
    try:
        stream = stream or sys.stderr
        if os.environ.get("RANK", "0") != "0" or not is_interactive(stream):
            return False
        key = marker_key()
        if marker_path(key).is_file():
            return False
        print(
            f"slipstream: first run on {key['device']}; check its fast paths with: slipstream doctor",
            file=stream,
        )
        return True
    except Exception:  # noqa: BLE001 - a hint must never break the command it decorates
        return False
