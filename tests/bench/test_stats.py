"""The verdicts, on synthetic data with known answers."""

import dataclasses
import random

import pytest

from slipstream.bench.stats import FP32_MARGINS, against_fp32, loss_parity, speedup


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


def test_step_zero_is_judged_strictly_on_the_loss_and_the_gradient_norm():
    curve, grads = [2.0, 1.8, 1.5, 1.4], [9.0, 8.0, 7.0, 6.0]
    # 5e-4 at step 0 is within fp32's curve tolerance (1e-3) but not step 0's (1e-4): a different step
    off = loss_parity(curve, [2.001, 1.8, 1.5, 1.4], "float32", grads, grads)
    assert (
        off.verdict == "diverged"
        and "step 0 loss 5.0e-04" in off.detail
        and "compute different" in off.detail
    )
    # the same loss with a gradient norm 1% off: the backward differs
    grad_off = loss_parity(curve, curve, "float32", grads, [9.09, 8.0, 7.0, 6.0])
    assert grad_off.verdict == "diverged" and "grad norm 1.0e-02" in grad_off.detail
    # bf16 allows bf16's rounding at step 0
    fine = loss_parity(curve, [2.004, 1.8, 1.5, 1.4], "bfloat16", grads, [9.01, 8.0, 7.0, 6.0])
    assert fine.verdict == "within tolerance" and fine.first_step_grad_norm == pytest.approx(1 / 900)


def chaotic(start_diff: float, growth: float, steps: int = 6) -> tuple[list[float], list[float]]:
    """A reference curve and one whose relative difference starts at ``start_diff`` and grows x``growth``
    a step (alternating sign), as rounding grows in a chaotic run."""
    reference = [2.0 + 0.5 * ((-1) ** k) for k in range(steps)]
    other = [r * (1 + start_diff * growth**k * (-1) ** k) for k, r in enumerate(reference)]
    return reference, other


def test_a_drift_that_grows_as_the_run_grows_a_one_ulp_perturbation_is_named_as_such():
    reference, arm = chaotic(5e-6, 5.0)  # 5e-6 at step 0, ~1.6e-2 by step 5
    first = loss_parity(reference, arm, "float32")
    assert first.verdict == "diverged" and first.needs_sensitivity  # it waits on the run's sensitivity
    _, perturbed = chaotic(1e-7, 5.5)  # the reference's own curve from weights one ulp away grows as fast
    judged = loss_parity(reference, arm, "float32", sensitivity=perturbed)
    assert judged.verdict == "drift within sensitivity" and not judged.needs_sensitivity
    assert judged.growth == pytest.approx(5.0**5, rel=1e-3) and judged.sensitivity_growth > 5.0**5
    assert "within 10x the run's own sensitivity" in judged.detail


def test_a_difference_a_stable_run_does_not_grow_by_itself_is_diverged():
    reference, arm = chaotic(5e-6, 5.0)  # grows x5 a step ...
    _, perturbed = chaotic(1e-7, 1.1)  # ... where the run barely grows its own perturbation: not drift
    judged = loss_parity(reference, arm, "float32", sensitivity=perturbed)
    assert judged.verdict == "diverged" and "beyond 10x the run's own sensitivity" in judged.detail


def test_a_one_ulp_kick_larger_than_the_arms_own_difference_bounds_the_drift_directly():
    """bf16: an ulp of every weight moves the loss more at step 0 than the arm's rounding does, and a
    chaotic run carries both to the same spread; the arm's drift is then judged against that spread."""
    reference = [2.0 + 0.5 * ((-1) ** k) for k in range(8)]
    arm = [r * (1 + min(3e-6 * 10.0**k, 0.12) * (-1) ** k) for k, r in enumerate(reference)]
    perturbed = [r * (1 + min(5e-5 * 3.0**k, 0.10) * (-1) ** (k + 1)) for k, r in enumerate(reference)]
    judged = loss_parity(reference, arm, "bfloat16", sensitivity=perturbed)
    assert judged.verdict == "drift within sensitivity", judged.detail
    calm = [r * (1 + 5e-5) for r in reference]  # the run does not carry a kick far: the arm's 12% is its own
    assert loss_parity(reference, arm, "bfloat16", sensitivity=calm).verdict == "diverged"


def test_with_repeats_the_interval_is_as_wide_as_the_processes_disagree():
    """Two repeats whose processes disagree (the candidate 2x faster in one, 1.2x in the other, each
    steady within itself): resampled by repeat the interval reaches both processes' ratios and is wider
    than the steps' alone. One repeat: the interval is the step-level one, as before."""
    from slipstream.bench.stats import speedup

    base = [1.0, 1.02, 0.98, 1.01] * 2
    candidate = [0.5, 0.51, 0.49, 0.5] + [0.83, 0.84, 0.82, 0.83]
    pooled = speedup(base, candidate)
    by_repeat = speedup(base, candidate, repeats=2)
    assert pooled.ratio == by_repeat.ratio
    assert by_repeat.low <= 1.21 and by_repeat.high >= 1.99  # each process's own ratio (1.2x, 2.0x) inside
    assert by_repeat.high - by_repeat.low > pooled.high - pooled.low
    assert speedup(base, candidate, repeats=1) == pooled


def test_step_zero_against_fp32_judges_each_arm_by_its_distance_next_to_the_references():
    reference = {"loss": 1.5e-3, "grad_norm": 4.5e-2, "cosine": 0.9999}
    # far from the reference arm (4.8% in the gradient norm) but nearer fp32 than it: passes
    nearer = against_fp32({"loss": 1e-4, "grad_norm": 3e-3, "cosine": 0.99995}, reference, "bfloat16")
    assert not nearer.diverged and nearer.judgement == "as near fp32 as the reference or nearer"
    assert nearer.margins == FP32_MARGINS["bfloat16"]
    # a little further, within the margin
    within = against_fp32({"loss": 4e-3, "grad_norm": 6e-2, "cosine": 0.9995}, reference, "bfloat16")
    assert not within.diverged and within.judgement == "within the margin"
    # an attention leaking across documents: further in all three by more than the margin
    leak = against_fp32({"loss": 1.2e-2, "grad_norm": 0.12, "cosine": 0.6}, reference, "bfloat16")
    assert leak.diverged and leak.further == ("loss", "gradient norm", "gradient direction")
    assert (
        "the arms compute different steps" in leak.detail
        and "gradient cosine 0.600000 vs 0.999900" in leak.detail
    )
    # the direction alone, and a cosine not measured leaves it unjudged
    turned = {"loss": 1.5e-3, "grad_norm": 4.5e-2, "cosine": 0.99}
    assert against_fp32(turned, reference, "bfloat16").further == ("gradient direction",)
    unmeasured = against_fp32({**turned, "cosine": None}, reference, "bfloat16")
    assert not unmeasured.diverged and "gradient cosine not measured" in unmeasured.detail


def test_loss_parity_takes_the_fp32_judgement_in_place_of_the_strict_step_zero():
    curve, grads = [2.0, 1.8, 1.5, 1.4], [9.0, 8.0, 7.0, 6.0]
    apart = [2.003, 1.8, 1.5, 1.4], [9.45, 8.0, 7.0, 6.0]  # 1.5e-3 and 5% apart at step 0
    assert loss_parity(curve, apart[0], "bfloat16", grads, apart[1]).verdict == "diverged"  # strictly
    reference = {"loss": 1.5e-3, "grad_norm": 4.8e-2, "cosine": 0.9999}
    nearer = against_fp32({"loss": 0.0, "grad_norm": 0.0, "cosine": 1.0}, reference, "bfloat16")
    judged = loss_parity(curve, apart[0], "bfloat16", grads, apart[1], first_step=nearer)
    assert judged.verdict == "within tolerance" and "step 0 against fp32" in judged.detail
    further = against_fp32(reference, {"loss": 0.0, "grad_norm": 0.0, "cosine": 1.0}, "bfloat16")
    judged = loss_parity(curve, apart[0], "bfloat16", grads, apart[1], first_step=further)
    assert judged.verdict == "diverged" and "further from fp32 than the reference" in judged.detail


def test_fewer_than_three_timed_steps_make_no_interval_and_say_why():
    """One timed step bootstrapped is that step's ratio twice ('1.92x [1.92, 1.92]'): too few steps
    give the ratio alone, and the number of steps that left it without an interval."""
    from slipstream.bench.stats import format_speedup

    one = speedup([1.92], [1.0])
    assert (one.low, one.high, one.verdict, one.timed_steps) == (None, None, "no interval", 1)
    assert format_speedup(one.ratio, dataclasses.asdict(one)) == "1.92x (1 timed step: no interval)"
    two = dataclasses.asdict(speedup([2.0, 2.0, 2.0], [1.0, 1.0]))  # unpaired: the fewer steps count
    assert two["low"] is None and format_speedup(2.0, two) == "2.00x (2 timed steps: no interval)"
    three = speedup([2.0, 2.1, 1.9], [1.0, 1.0, 1.0])
    assert three.low is not None and three.timed_steps == 3 and three.verdict == "faster"
    assert format_speedup(three.ratio, dataclasses.asdict(three)).startswith("2.00x [")
    assert format_speedup(1.5) == "1.50x"  # (no interval given: an older record's bare ratio)
