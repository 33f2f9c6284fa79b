"""Has doctor passed on this device? A small marker per (device name, torch version) in the cache.

``slipstream doctor`` writes the marker after a run with no WRONG path; ``slipstream train`` and
``slipstream ab`` call :func:`first_use_hint`, which prints one line to stderr while there is
none. Nothing here may break a command: an unwritable or unreadable cache only loses the hint.
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
from .machine import device_name, training_device


def marker_key(device: torch.device | None = None) -> dict[str, str]:
    return {"device": device_name(device or training_device()), "torch": torch.__version__}


def marker_path(key: dict[str, str]) -> Path:
    digest = hashlib.sha256(f"{key['device']}\0{key['torch']}".encode()).hexdigest()[:16]
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


def first_use_hint(stream: TextIO | None = None) -> bool:
    """Print one line pointing at ``slipstream doctor`` if it never passed on this device; True if printed.

    Only rank 0 speaks under torchrun; any failure (no cache, no device name) prints nothing."""
    try:
        if os.environ.get("RANK", "0") != "0":
            return False
        key = marker_key()
        if marker_path(key).is_file():
            return False
        print(
            f"slipstream: first run on {key['device']}; check its fast paths with: slipstream doctor",
            file=stream or sys.stderr,
        )
        return True
    except Exception:  # noqa: BLE001 - a hint must never break the command it decorates
        return False
