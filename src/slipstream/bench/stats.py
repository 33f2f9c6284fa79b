"""Verdicts a careful engineer can trust: a speedup with a bootstrap interval, and loss parity.

Arms of an A/B run the same steps on the same data, so their step times are paired: the
speedup is total baseline time / total candidate time over the same steps (the ratio of
their real-token throughputs), and its 95% interval comes from resampling the steps with
replacement, both arms together. Unpaired samples fall back to a ratio of medians with each
arm resampled on its own. "faster" / "slower" only when the whole interval clears 1.0,
otherwise "within noise". Deterministic for a seed.
"""

from __future__ import annotations

import random
import statistics
from dataclasses import dataclass

# Relative per-step loss differences: (identical up to, within tolerance up to), by dtype.
LOSS_TOLERANCES = {"float32": (1e-6, 1e-3), "bfloat16": (1e-3, 3e-2), "float16": (1e-3, 3e-2)}


@dataclass(frozen=True)
class Speedup:
    ratio: float  # baseline time / candidate time for the same steps (a throughput ratio)
    low: float
    high: float
    verdict: str  # "faster", "slower" or "within noise"


def speedup(
    baseline_s: list[float],
    candidate_s: list[float],
    resamples: int = 2000,
    seed: int = 0,
    confidence: float = 0.95,
) -> Speedup:
    """Speedup of ``candidate`` over ``baseline`` (step times) with a bootstrap interval."""
    if not baseline_s or not candidate_s:
        raise ValueError("speedup needs timed steps in both arms")
    rng = random.Random(seed)
    paired = len(baseline_s) == len(candidate_s)
    if paired:
        ratio = sum(baseline_s) / sum(candidate_s)
    else:
        ratio = statistics.median(baseline_s) / statistics.median(candidate_s)
    samples = []
    n = len(baseline_s)
    for _ in range(resamples):
        if paired:
            picks = [rng.randrange(n) for _ in range(n)]
            samples.append(sum(baseline_s[i] for i in picks) / sum(candidate_s[i] for i in picks))
        else:
            base = statistics.median(rng.choices(baseline_s, k=len(baseline_s)))
            samples.append(base / statistics.median(rng.choices(candidate_s, k=len(candidate_s))))
    samples.sort()
    tail = (1 - confidence) / 2
    low, high = samples[int(tail * resamples)], samples[min(resamples - 1, int((1 - tail) * resamples))]
    verdict = "faster" if low > 1.0 else "slower" if high < 1.0 else "within noise"
    return Speedup(ratio=ratio, low=low, high=high, verdict=verdict)


@dataclass(frozen=True)
class Parity:
    verdict: str  # "identical", "within tolerance" or "diverged"
    max_rel_diff: float
    worst_step: int


def loss_parity(reference: list[float], other: list[float], dtype: str) -> Parity:
    """Per-step relative loss difference, judged with the dtype's tolerance."""
    if len(reference) != len(other):
        raise ValueError(
            f"loss curves of different lengths ({len(reference)} and {len(other)}) cannot be compared"
        )
    diffs = [abs(a - b) / max(abs(a), 1e-12) for a, b in zip(reference, other, strict=True)]
    worst_step = max(range(len(diffs)), key=diffs.__getitem__) if diffs else 0
    worst = diffs[worst_step] if diffs else 0.0
    identical, tolerance = LOSS_TOLERANCES.get(dtype, LOSS_TOLERANCES["bfloat16"])
    verdict = "identical" if worst <= identical else "within tolerance" if worst <= tolerance else "diverged"
    return Parity(verdict=verdict, max_rel_diff=worst, worst_step=worst_step)
