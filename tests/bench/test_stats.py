"""The verdicts, on synthetic data with known answers."""

import random

import pytest

from slipstream.bench.stats import loss_parity, speedup


def noisy(base, n, spread, seed):
    rng = random.Random(seed)
    return [base * (1 + rng.uniform(-spread, spread)) for _ in range(n)]


def test_a_known_10_percent_gap_is_called_faster_and_the_interval_contains_it():
    baseline = noisy(1.10, 40, 0.03, seed=1)
    candidate = noisy(1.00, 40, 0.03, seed=2)
    result = speedup(baseline, candidate)
    assert result.verdict == "faster"
    assert result.low <= 1.10 <= result.high
    assert speedup(candidate, baseline).verdict == "slower"


def test_equal_distributions_are_within_noise():
    result = speedup(noisy(1.0, 30, 0.05, seed=3), noisy(1.0, 30, 0.05, seed=4))
    assert result.verdict == "within noise"
    assert result.low < 1.0 < result.high


def test_unpaired_samples_use_medians():
    result = speedup(noisy(2.0, 21, 0.02, seed=5), noisy(1.0, 15, 0.02, seed=6))
    assert result.verdict == "faster" and 1.9 < result.ratio < 2.1


def test_loss_parity_verdicts_by_dtype():
    curve = [2.0, 1.8, 1.5, 1.4]
    assert loss_parity(curve, curve, "float32").verdict == "identical"
    assert loss_parity(curve, [2.0, 1.8, 1.5001, 1.4], "float32").verdict == "within tolerance"
    diverged = loss_parity(curve, [2.0, 1.8, 1.6, 1.4], "float32")
    assert diverged.verdict == "diverged" and diverged.worst_step == 2
    assert loss_parity(curve, [2.0, 1.8, 1.52, 1.4], "bfloat16").verdict == "within tolerance"
    with pytest.raises(ValueError, match="different lengths"):
        loss_parity(curve, curve[:2], "float32")
