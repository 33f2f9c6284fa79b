"""Verdicts a careful engineer can trust: a speedup with a bootstrap interval, and loss parity.

Arms of an A/B run the same steps on the same data, so their step times are paired: the
speedup is total baseline time / total candidate time over the same steps (the ratio of
their real-token throughputs), and its 95% interval comes from resampling the steps with
replacement, both arms together. Unpaired samples fall back to a ratio of medians with each
arm resampled on its own. "faster" / "slower" only when the whole interval clears 1.0,
otherwise "within noise". Deterministic for a seed. Fewer than ``MIN_TIMED_STEPS`` timed steps
make no interval: the ratio stands alone, and says why.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Mapping
from dataclasses import dataclass

# Relative per-step loss differences: (identical up to, within tolerance up to), by dtype.
LOSS_TOLERANCES = {"float32": (1e-6, 1e-3), "bfloat16": (1e-3, 3e-2), "float16": (1e-3, 3e-2)}


# A resample of one or two timed steps only draws them again: the "interval" of one step is that
# step's ratio twice ("1.92x [1.92, 1.92]"), which claims a certainty it does not have.
MIN_TIMED_STEPS = 3
NO_INTERVAL = "no interval"


@dataclass(frozen=True)
class Speedup:
    ratio: float  # baseline time / candidate time for the same steps (a throughput ratio)
    low: float | None  # None (and high): too few timed steps for an interval (MIN_TIMED_STEPS)
    high: float | None
    verdict: str  # "faster", "slower", "within noise", or NO_INTERVAL
    timed_steps: int  # the fewer of the two arms' (every repeat's together)


def interval_words(interval: Mapping | None) -> str:
    """' [1.39, 1.50]', or why there is none (' (1 timed step: no interval)'); '' without ``interval``."""
    if not interval:
        return ""
    if interval.get("low") is None:
        steps = interval.get("timed_steps")
        return f" ({steps} timed step{'' if steps == 1 else 's'}: {NO_INTERVAL})"
    return f" [{interval['low']:.2f}, {interval['high']:.2f}]"


def format_speedup(ratio: float, interval: Mapping | None = None) -> str:
    """'1.44x [1.39, 1.50] faster': how every table writes a speedup (``interval``: low, high, verdict);
    '1.92x (1 timed step: no interval)' where too few steps were timed for one."""
    shown = f"{ratio:.2f}x{interval_words(interval)}"
    return shown if not interval or interval.get("low") is None else f"{shown} {interval['verdict']}"


def speedup(
    baseline_s: list[float],
    candidate_s: list[float],
    resamples: int = 2000,
    seed: int = 0,
    confidence: float = 0.95,
    repeats: int = 1,
) -> Speedup:
    """Speedup of ``candidate`` over ``baseline`` (step times) with a bootstrap interval.

    ``repeats``: the paired steps are that many equal blocks, one per repeat (a fresh process of each
    arm). Processes of the same arm differ by more than its steps do (memory layout, where the host
    backed its pages, the machine's phase that run), so the interval then resamples the repeats
    first and the steps within each: it is as wide as the repeats disagree. With one repeat it covers
    the step-to-step noise of one process per arm only."""
    if not baseline_s or not candidate_s:
        raise ValueError("speedup needs timed steps in both arms")
    rng = random.Random(seed)
    paired = len(baseline_s) == len(candidate_s)
    if paired:
        ratio = sum(baseline_s) / sum(candidate_s)
    else:
        ratio = statistics.median(baseline_s) / statistics.median(candidate_s)
    timed = min(len(baseline_s), len(candidate_s))
    if timed < MIN_TIMED_STEPS:
        return Speedup(ratio=ratio, low=None, high=None, verdict=NO_INTERVAL, timed_steps=timed)
    samples = []
    n = len(baseline_s)
    block = n // repeats if paired and repeats > 1 and n % repeats == 0 else n
    for _ in range(resamples):
        if paired:
            if block == n:
                picks = [rng.randrange(n) for _ in range(n)]
            else:  # the repeats first, then the steps within each
                starts = [rng.randrange(n // block) * block for _ in range(n // block)]
                picks = [start + rng.randrange(block) for start in starts for _ in range(block)]
            samples.append(sum(baseline_s[i] for i in picks) / sum(candidate_s[i] for i in picks))
        else:
            base = statistics.median(rng.choices(baseline_s, k=len(baseline_s)))
            samples.append(base / statistics.median(rng.choices(candidate_s, k=len(candidate_s))))
    samples.sort()
    tail = (1 - confidence) / 2
    low, high = samples[int(tail * resamples)], samples[min(resamples - 1, int((1 - tail) * resamples))]
    verdict = "faster" if low > 1.0 else "slower" if high < 1.0 else "within noise"
    return Speedup(ratio=ratio, low=low, high=high, verdict=verdict, timed_steps=timed)


# Step 0 runs the same weights on the same batch in every arm, so a real difference in what a step
# computes shows there, before any trajectory can drift: relative differences of (the loss, the
# gradient norm) allowed there, by dtype. Measured on SmolLM2-135M (LoRA r8, 1,024-token chat bins),
# slipstream against stock transformers: fp32 3e-6 / 2e-6, bf16 1e-3 / 2e-3; with the packed
# attention broken to leak across documents: fp32 1e-2 / 0.12, bf16 1e-2 / 0.12 (BENCHMARKS.md).
FIRST_STEP_TOLERANCES = {"float32": (1e-4, 1e-3), "bfloat16": (5e-3, 2e-2), "float16": (5e-3, 2e-2)}
# The smallest relative loss difference told apart from none, by dtype (a floor for growth ratios).
DIFFERENCE_FLOOR = {"float32": 1e-7, "bfloat16": 1e-5, "float16": 1e-5}
# A later step's difference counts as the run's own drift while it is at most this many times how far a
# one-ulp perturbation of the reference's weights moved it by then (``sensitivity``), scaled to the
# arm's step-0 difference where that is the larger start.
DRIFT_FACTOR = 10.0
# A reduced-precision run's step 0 is judged against the truth instead (``bench/truth.py``): the same
# step once more in fp32 (same weights, same batch), each arm's distance to it next to the reference
# arm's. Two correct arms in bf16 may differ from each other by more than FIRST_STEP_TOLERANCES (each
# rounds in its own kernel order: SmolLM2-135M's step 0 in bf16 came out 1.5e-3 apart in the loss and
# 4.8% in the gradient norm, stock against slipstream), and a difference alone cannot say which arm is
# off. An arm diverges when it is further from fp32 than the reference arm by more than these margins,
# by dtype: (relative loss, relative gradient norm, 1 - the gradient's cosine). The loss's and the
# norm's are FIRST_STEP_TOLERANCES' bf16 figures (an attention leaking across documents moves them by
# 1e-2 and 0.12 on SmolLM2-135M); the direction's is 1e-3 (an angle of 2.6 degrees). Correct arms share
# most of bf16's error, so their excess over the reference is far below their own distance: on
# SmolLM2-135M (LoRA r8, the demo rows' 1,024-token bins) stock-packed and slipstream both sat 9.2e-4
# from fp32 in the loss, 8.1e-3 / 8.2e-3 in the gradient norm and 4.2e-4 / 4.2e-4 in 1 - cosine (an
# excess of 5e-6); with LoRA r16 on 512-token bins 1.0e-2 / 1.2e-2 and 9.7e-4 / 9.5e-4. On the tiny Qwen3
# correct arms sit 6e-5 from fp32 in 1 - cosine (a full fine-tune; 9e-6 with LoRA r8, 3e-5 in the DPO and
# GRPO arms, TRL's included), and an attention leaking across documents 0.41 (0.30 in the gradient norm,
# 2.4e-3 in the loss; tests/bench/test_ab.py's deliberately wrong attention).
FP32_MARGINS = {"bfloat16": (5e-3, 2e-2, 1e-3), "float16": (5e-3, 2e-2, 1e-3)}


@dataclass(frozen=True)
class FirstStepTruth:
    """An arm's step 0 against the same step in fp32, next to the reference arm's (:func:`against_fp32`)."""

    loss: float  # |loss - fp32 loss| / |fp32 loss|
    grad_norm: float  # |gradient norm - fp32's| / fp32's
    cosine: float | None  # the cosine of its gradient and fp32's (None: not measured)
    reference_loss: float
    reference_grad_norm: float
    reference_cosine: float | None
    margins: tuple[float, float, float]  # FP32_MARGINS of the pair's dtype
    further: tuple[str, ...]  # what is further from fp32 than the reference's by more than its margin
    diverged: bool
    # "as near fp32 as the reference or nearer", "within the margin", "further than the margin"
    judgement: str
    detail: str  # one sentence: both distances, and the judgement


def _cosine_words(cosine: float | None) -> str:
    return "not measured" if cosine is None else f"{cosine:.6f}"


def against_fp32(arm: Mapping, reference: Mapping, dtype: str) -> FirstStepTruth:
    """Judge an arm's step 0 by its distance to the fp32 step next to the reference arm's (``arm`` and
    ``reference``: ``{"loss", "grad_norm", "cosine"}`` as :class:`FirstStepTruth` has them; a cosine may
    be None, and the direction is then not judged). It diverges when any distance exceeds the
    reference's by more than the dtype's :data:`FP32_MARGINS`; an arm nearer fp32 than the reference
    passes however far apart the two arms are."""
    key = dtype if dtype in FP32_MARGINS else "bfloat16"
    margins = FP32_MARGINS[key]
    excess = {
        "loss": arm["loss"] - reference["loss"],
        "gradient norm": arm["grad_norm"] - reference["grad_norm"],
    }
    if arm.get("cosine") is not None and reference.get("cosine") is not None:
        excess["gradient direction"] = reference["cosine"] - arm["cosine"]  # (1 - cos) - (1 - cos_ref)
    further = tuple(
        name for (name, value), margin in zip(excess.items(), margins, strict=False) if value > margin
    )
    distances = (
        f"step 0 against fp32 (same weights, same batch): loss {arm['loss']:.1e} from it vs the reference's "
        f"{reference['loss']:.1e}, gradient norm {arm['grad_norm']:.1e} vs {reference['grad_norm']:.1e}, "
        f"gradient cosine {_cosine_words(arm.get('cosine'))} vs {_cosine_words(reference.get('cosine'))}"
    )
    allowed = f"{margins[0]:g} / {margins[1]:g} / {margins[2]:g} in {key}"
    if further:
        judgement = "further than the margin"
        words = (
            f"further from fp32 than the reference in its {', '.join(further)} by more than the margin "
            f"({allowed}): the arms compute different steps"
        )
    elif all(value <= 0 for value in excess.values()):
        judgement = words = "as near fp32 as the reference or nearer"
    else:
        judgement = "within the margin"
        words = f"within the margin ({allowed}) of the reference's distance"
    return FirstStepTruth(
        loss=arm["loss"],
        grad_norm=arm["grad_norm"],
        cosine=arm.get("cosine"),
        reference_loss=reference["loss"],
        reference_grad_norm=reference["grad_norm"],
        reference_cosine=reference.get("cosine"),
        margins=margins,
        further=further,
        diverged=bool(further),
        judgement=judgement,
        detail=f"{distances}: {words}",
    )


@dataclass(frozen=True)
class Parity:
    """How an arm's loss curve compares with the reference arm's (:func:`loss_parity`)."""

    verdict: str  # "identical", "within tolerance", "drift within sensitivity" or "diverged"
    max_rel_diff: float
    worst_step: int
    first_step_loss: float  # step 0's relative loss difference
    first_step_grad_norm: float | None  # step 0's relative gradient-norm difference (None: not given)
    detail: str  # one sentence: what was judged and how
    needs_sensitivity: bool = False  # beyond the tolerance after a clean step 0, and no sensitivity given
    growth: float | None = None  # the worst step's difference over step 0's (floored)
    sensitivity_growth: float | None = None  # the same for the one-ulp perturbed reference


def _relative(reference: list[float], other: list[float]) -> list[float]:
    return [abs(a - b) / max(abs(a), 1e-12) for a, b in zip(reference, other, strict=True)]


def loss_parity(
    reference: list[float],
    other: list[float],
    dtype: str,
    reference_grad_norm: list[float] | None = None,
    other_grad_norm: list[float] | None = None,
    sensitivity: list[float] | None = None,
    first_step: FirstStepTruth | None = None,
) -> Parity:
    """Judge ``other``'s loss curve against ``reference``'s, as "computes the same step" first, then
    "the trajectory".

    1. Step 0 (same weights, same batch) is strict: its loss and gradient norm within
       :data:`FIRST_STEP_TOLERANCES` of the reference's, else "diverged": the arms compute different
       things. With ``first_step`` (a reduced-precision run's step 0 against fp32, :func:`against_fp32`)
       that judgement is its instead: "diverged" where the arm is further from fp32 than the reference
       by more than the margin, and otherwise on to the curve, however far apart the two arms' step 0.
    2. Every step within the dtype's :data:`LOSS_TOLERANCES`: "identical" / "within tolerance".
    3. Later steps beyond it: training amplifies any difference (a high learning rate on a real model
       can grow fp32 rounding a thousandfold in five steps), so it is compared with the run's own.
       ``sensitivity`` is the reference arm's loss curve rerun from its weights moved by one ulp
       (random signs): ``s_k``, its difference from the reference by step k (the largest so far), is
       how far this run carries a difference no arm made. Where this arm's step-0 difference is
       larger than ``s_0`` (fp32: an ulp of the weights moves the loss less than rounding in another
       kernel order does), ``s_k`` is scaled up by their ratio. A step's difference up to
       :data:`DRIFT_FACTOR` x that is "drift within sensitivity"; past it, or with no sensitivity
       measured, "diverged". Without ``sensitivity`` the result says ``needs_sensitivity`` (the caller
       may measure it).
    """
    if len(reference) != len(other):
        raise ValueError(
            f"loss curves of different lengths ({len(reference)} and {len(other)}) cannot be compared"
        )
    diffs = _relative(reference, other)
    worst_step = max(range(len(diffs)), key=diffs.__getitem__) if diffs else 0
    worst = diffs[worst_step] if diffs else 0.0
    key = dtype if dtype in LOSS_TOLERANCES else "bfloat16"
    identical, tolerance = LOSS_TOLERANCES[key]
    first_loss_tol, first_grad_tol = FIRST_STEP_TOLERANCES[key]
    first_loss = diffs[0] if diffs else 0.0
    first_grad = None
    if reference_grad_norm and other_grad_norm:
        first_grad = _relative(reference_grad_norm[:1], other_grad_norm[:1])[0]
    found = {"max_rel_diff": worst, "worst_step": worst_step, "first_step_loss": first_loss}
    found["first_step_grad_norm"] = first_grad
    step0 = f"step 0 loss {first_loss:.1e}" + (
        f", grad norm {first_grad:.1e}" if first_grad is not None else ""
    )
    if first_step is not None:
        if first_step.diverged:
            return Parity("diverged", **found, detail=f"{step0} from the reference's; {first_step.detail}")
        step0 = f"{step0} from the reference's; {first_step.detail}"
    elif first_loss > first_loss_tol or (first_grad is not None and first_grad > first_grad_tol):
        return Parity(
            "diverged",
            **found,
            detail=f"{step0} (same weights, same batch; allowed {first_loss_tol:g} / {first_grad_tol:g} in "
            f"{key}): the arms compute different steps",
        )
    if worst <= tolerance:
        verdict = "identical" if worst <= identical else "within tolerance"
        return Parity(verdict, **found, detail=f"{step0}; every step within {tolerance:g} ({key})")
    floor = DIFFERENCE_FLOOR[key]
    growth = worst / max(first_loss, floor)
    beyond = f"{step0}, then {worst:.1e} at step {worst_step} (x{growth:.3g}; tolerance {tolerance:g})"
    if sensitivity is None:
        return Parity(
            "diverged",
            **found,
            detail=f"{beyond}; the run's own sensitivity was not measured",
            needs_sensitivity=True,
            growth=growth,
        )
    # How far a one-ulp perturbation of the reference has moved it by each step (the largest so far),
    # scaled up to this arm's own step-0 difference where that is the bigger start: the difference a
    # run that only amplifies what it is given would show by then.
    spread = _relative(reference, sensitivity)
    start = max(spread[0], floor)
    scale = max(1.0, max(first_loss, floor) / start)
    envelope, expected = 0.0, []
    for value in spread:
        envelope = max(envelope, value, floor)
        expected.append(envelope * scale)
    worst_ratio = max(d / (DRIFT_FACTOR * e) for d, e in zip(diffs, expected, strict=True))
    sensitivity_growth = expected[worst_step] / (start * scale)
    verdict = "drift within sensitivity" if worst_ratio <= 1.0 else "diverged"
    relation = "within" if verdict != "diverged" else "beyond"
    return Parity(
        verdict,
        **found,
        growth=growth,
        sensitivity_growth=sensitivity_growth,
        detail=f"{beyond}; a one-ulp perturbation of the reference had moved it up to {expected[worst_step] / scale:.1e} "
        f"by then (x{sensitivity_growth:.3g} its step-0 {spread[0]:.1e})"
        + (f", x{scale:.3g} for this arm's larger step-0 difference" if scale > 1 else "")
        + f", so this is {relation} {DRIFT_FACTOR:g}x the run's own sensitivity",
    )


@dataclass(frozen=True)
class MarginParity:
    """How an arm's DPO reward-margin curve compares with the reference arm's (:func:`margin_parity`)."""

    verdict: str  # "within tolerance" or "differs"
    max_scaled_diff: float
    worst_step: int
    detail: str


def margin_parity(
    reference: list[float],
    other: list[float],
    dtype: str,
    beta: float,
    sensitivity: list[float] | None = None,
) -> MarginParity:
    """The reward margin starts at exactly 0 (policy = reference), so a relative difference means
    nothing there: each step's difference is scaled by ``max(|reference margin|, beta)`` (beta: the
    margin of one nat of log-ratio) and must stay within the dtype's loss-curve tolerance; beyond it,
    within :data:`DRIFT_FACTOR` x what the reference arm rerun from weights one ulp away moved it by
    then (``sensitivity``: its margins) is "drift within sensitivity", else "differs"."""
    if len(reference) != len(other):
        raise ValueError("reward-margin curves of different lengths cannot be compared")

    def scaled_diffs(curve: list[float]) -> list[float]:
        return [abs(a - b) / max(abs(a), beta) for a, b in zip(reference, curve, strict=True)]

    scaled = scaled_diffs(other)
    worst_step = max(range(len(scaled)), key=scaled.__getitem__) if scaled else 0
    worst = scaled[worst_step] if scaled else 0.0
    key = dtype if dtype in LOSS_TOLERANCES else "bfloat16"
    tolerance = LOSS_TOLERANCES[key][1]
    detail = f"largest |difference| / max(|margin|, beta) {worst:.1e} at step {worst_step} (tolerance {tolerance:g}, {key})"
    if worst <= tolerance:
        return MarginParity("within tolerance", worst, worst_step, detail)
    if sensitivity is not None and len(sensitivity) == len(reference):
        moved = scaled_diffs(sensitivity)
        allowed = [DRIFT_FACTOR * max(moved[: step + 1]) for step in range(len(moved))]
        if all(d <= max(a, tolerance) for d, a in zip(scaled, allowed, strict=True)):
            return MarginParity(
                "drift within sensitivity",
                worst,
                worst_step,
                f"{detail}; a one-ulp perturbation of the reference moved it up to {max(moved):.1e}, and "
                f"every step is within {DRIFT_FACTOR:g}x that",
            )
    return MarginParity("differs", worst, worst_step, detail)
