"""Hardware and software fingerprint stored with every benchmark record."""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path

import torch
import transformers

from .._version import __version__
from ..hardware import cpu_class, cpu_name


def _first_line(command: list[str], timeout: float, cwd: Path | None = None) -> str | None:
    """The first line ``command`` prints; None where it is missing, fails or prints nothing."""
    try:
        out = subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=timeout, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip().splitlines()[0] if out.stdout.strip() else None


def fingerprint() -> dict:
    """Where a figure was measured: device, CPU, library versions, git revision."""
    info = {
        "cpu": cpu_name(),
        "cpu_class": cpu_class().name,  # hardware.CPU_CLASSES; SLIPSTREAM_CPU_CLASS overrides the probe
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "slipstream": __version__,
        "git_revision": _first_line(
            ["git", "rev-parse", "--short", "HEAD"], timeout=5, cwd=Path(__file__).resolve().parent
        ),
        "device": "cpu",
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(
            device=props.name,
            device_memory_gb=round(props.total_memory / 2**30, 1),
            cuda=torch.version.cuda,
            driver=_first_line(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"], 10),
        )
    return info


def describe(info: dict) -> str:
    """One line for a report: "cpu: AMD EPYC ... (2 threads), torch 2.13.0, transformers 5.24.0"."""
    where = (
        info["device"] if info["device"] != "cpu" else f"cpu: {info['cpu']} ({info['torch_threads']} threads)"
    )
    return (
        f"{where}, torch {info['torch']}, transformers {info['transformers']}, slipstream {info['slipstream']}"
        + (f" @ {info['git_revision']}" if info.get("git_revision") else "")
    )
