"""Does ``auto`` hold on this device? The leave-one-out arms judged against it, and remembered.

An ablation run (``slipstream ab --preset ablation``) trains ``slipstream`` (every ``auto`` as it
chooses) beside one arm per speedup with that speedup off, and ``slipstream-again``, the same
``slipstream`` arm in another process: an A/A pair whose difference is the run's own
process-to-process noise (the bootstrap interval of one pair of processes understates it: two
processes of the same arm measured 0.95-0.99x here, even in lockstep). A leave-one-out arm *beats
auto* only when its whole interval clears 1 by more than that noise.

Every such run leaves its verdicts in ``$SLIPSTREAM_CACHE/ablation/`` (per device, one entry per
workload and dtype, the newest kept), where ``slipstream doctor`` reads them: a device on which an
arm beats ``auto`` fails doctor's ablation check, naming the arm.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from pathlib import Path

import torch

from ..atomic import write_text_atomically
from ..data import cache_root
from ..hardware import device_identity
from .stats import speedup

AGAIN = "slipstream-again"


def ablation_verdicts(summary: dict, timed: dict[str, list[float]], seed: int = 0) -> dict | None:
    """Each ``slipstream-no-*`` arm against ``slipstream``: ``vs_slipstream`` (its speedup over it,
    with the 95% interval) and ``ablation_verdict``: "beats auto" when the interval's low end clears
    1 by more than the A/A noise margin, "slower than auto" when its high end falls short of 1 by
    more, else "within noise". The margin is the A/A pair's interval's farthest edge from 1 (0 without
    ``slipstream-again``). Returns ``{"noise_margin", "beats_auto", "a_a_control"}`` (also kept on the
    slipstream arm's summary), or None when the run has no ablation arm."""
    ablations = [arm for arm in timed if arm.startswith("slipstream-no-")]
    if "slipstream" not in timed or not ablations:
        return None
    margin = 0.0
    if AGAIN in timed:
        again = speedup(timed["slipstream"], timed[AGAIN], seed=seed)
        summary[AGAIN]["vs_slipstream"] = dataclasses.asdict(again)
        margin = max(abs(edge - 1) for edge in (again.ratio, again.low, again.high) if edge is not None)
    beats = []
    for arm in ablations:
        found = speedup(timed["slipstream"], timed[arm], seed=seed)
        if found.low is None:  # too few timed steps: no interval, so no verdict
            verdict = f"not judged ({found.verdict})"
        elif found.low > 1 + margin:
            verdict = "beats auto"
            beats.append(arm)
        elif found.high < 1 - margin:
            verdict = "slower than auto"
        else:
            verdict = "within noise"
        summary[arm]["vs_slipstream"] = dataclasses.asdict(found)
        summary[arm]["ablation_verdict"] = verdict
    result = {"noise_margin": margin, "beats_auto": beats, "a_a_control": AGAIN in timed}
    summary["slipstream"]["ablation"] = result
    return result


def _store_path(device: torch.device) -> Path:
    digest = hashlib.sha256(json.dumps(device_identity(device), sort_keys=True).encode()).hexdigest()[:16]
    return cache_root() / "ablation" / f"{digest}.json"


def remember(record: dict, device: torch.device) -> Path | None:
    """Keep an ablation record's verdicts for ``device`` (the newest per workload and dtype); the
    path written, or None when the record has none or the cache cannot be written."""
    ablation = record["summary"].get("slipstream", {}).get("ablation")
    if not ablation:
        return None
    config = record["config"]
    workload = (
        f"{record.get('inputs', {}).get('model', {}).get('path') or config['model']}, {config['dtype']}"
    )
    entry = {
        "workload": workload,
        "created": record.get("created") or time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "steps": config["steps"],
        "interleaving": [found["mode"] for found in record.get("interleaving", [])],
        **ablation,
        "arms": {
            arm: {**s["vs_slipstream"], "verdict": s.get("ablation_verdict", "A/A control")}
            for arm, s in record["summary"].items()
            if "vs_slipstream" in s
        },
    }
    path = _store_path(device)
    try:
        found = json.loads(path.read_text()) if path.is_file() else {}
        found[workload] = entry
        write_text_atomically(path, json.dumps(found, indent=1) + "\n")
    except (OSError, ValueError, RuntimeError):
        return None
    return path


def remembered(device: torch.device) -> dict[str, dict]:
    """The ablation verdicts kept for ``device``, by workload ({} when none, or unreadable)."""
    path = _store_path(device)
    try:
        return json.loads(path.read_text()) if path.is_file() else {}
    except (OSError, ValueError):
        return {}
