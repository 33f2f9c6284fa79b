"""One arm of the compatibility sweep and its outcome: pass, refused, WRONG or CRASH.

:func:`run_arm` runs a parity-kit arm (:class:`slipstream.parity.Arm`) under ``optimize(**options)``
against the stock reference step; :func:`failed` is the one place an exception becomes an outcome
(a slipstream refusal or a crash; the exception itself stays on the result, ``ArmResult.error``);
:func:`advice_of` is the one place the sweep reads the way out a refusal names.
"""

from __future__ import annotations

import copy
import traceback
from dataclasses import dataclass, field, fields
from typing import Any

import torch

from ..offload import RecordingEngine, UnsupportedCheckpointing
from ..parity import TOLERANCE, Arm, Errors, Step, compare, policies_of, problems
from ..refusal import avoid_of, refusal_in


@dataclass
class ArmResult:
    """One configuration run against the reference."""

    status: str  # pass | refused | WRONG | CRASH
    detail: str = ""
    logits_error: float | None = None
    loss_error: float | None = None
    grad_error: float | None = None
    worst_param: str | None = None
    policies: list[str] = field(default_factory=list)
    # "on" when the arm ran with offloaded checkpointing, "-" if the model has no layers for it
    offload: str = "-"
    # the exception a refused / crashed arm raised (kept in this process, never serialised)
    error: BaseException | None = field(default=None, repr=False, compare=False)

    def to_dict(self) -> dict[str, Any]:
        """Its fields but ``error``, as ``dataclasses.asdict`` gives them."""
        return {f.name: copy.deepcopy(getattr(self, f.name)) for f in fields(self) if f.name != "error"}


@dataclass
class Verdict:
    """Everything the sweep learned about one architecture."""

    model_type: str
    class_name: str = ""
    status: str = "unbuilt"  # pass | refused | WRONG | CRASH | unbuilt
    detail: str = ""
    moe: bool = False
    speedups: dict[str, str] = field(default_factory=dict)  # speedup -> "on" | "off: why" | "-"
    arm: ArmResult | None = None
    fallback: dict[str, Any] | None = None  # {"advice": ..., "result": ArmResult}
    ablations: dict[str, ArmResult] = field(default_factory=dict)
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        """As ``dataclasses.asdict`` gives it, each arm without its caught exception."""

        def plain(value: Any) -> Any:
            if isinstance(value, ArmResult):
                return value.to_dict()
            if isinstance(value, dict):
                return {k: plain(v) for k, v in value.items()}
            return copy.deepcopy(value)

        return {f.name: plain(getattr(self, f.name)) for f in fields(self)}


# --------------------------------------------------------------------------- outcomes


def short(error: BaseException) -> str:
    """The exception's type and the first line of its message."""
    text = str(error).strip().splitlines()[0] if str(error).strip() else ""
    return f"{type(error).__name__}: {text}"[:400]


def where(error: BaseException) -> str:
    """Where it was raised (file:line, site-packages stripped)."""
    frames = traceback.extract_tb(error.__traceback__)
    if not frames:
        return "?"
    frame = frames[-1]
    return f"{frame.filename.rsplit('site-packages/', 1)[-1]}:{frame.lineno}"


def failed(error: BaseException) -> ArmResult:
    """An arm that raised: ``refused`` (a slipstream refusal, its message) or ``CRASH`` (anything
    else, its message and where it was raised); ``error`` keeps the exception."""
    if refusal_in(error) is not None:  # a deliberate slipstream refusal (refusal.Refusal), as data
        return ArmResult("refused", short(error), error=error)
    return ArmResult("CRASH", short(error) + " @ " + where(error), error=error)


def judged(errors: Errors) -> ArmResult:
    """``pass`` within :data:`slipstream.parity.TOLERANCE`, else ``WRONG`` naming what is off."""
    result = ArmResult("pass", logits_error=errors.logits, loss_error=errors.loss, grad_error=errors.grad)
    result.worst_param = errors.worst_param
    found = problems(errors, TOLERANCE)
    if found:
        result.status, result.detail = "WRONG", "; ".join(found)
    return result


def advice_of(result: ArmResult) -> dict[str, Any] | None:
    """The way out a refused arm's refusal carries (``Refusal.avoid``), which the sweep follows as a
    user would (``None``: none): read from the exception, never from its message."""
    return avoid_of(result.error)


# --------------------------------------------------------------------------- one arm


def run_arm(
    stock: torch.nn.Module,
    docs: list[list[int]],
    ref: Step,
    options: dict[str, Any],
    packed: bool = True,
    offload: bool = True,
) -> ArmResult:
    """A copy of ``stock`` under ``optimize(**options)`` (+ offload on the CPU's recording engine),
    one step on ``docs`` (packed in one row, or each alone), compared with ``ref`` (logits, loss,
    every gradient)."""
    arm = None
    try:
        arm = Arm(stock)
        arm.set_up(options, offload=RecordingEngine() if offload else None)
        step = arm.step(docs, "packed" if packed else "alone", logits=True)
        result = judged(compare(step, ref))
    except Exception as error:  # noqa: BLE001 - every failure is an outcome here
        result = failed(error)
    result.offload = "on" if arm is not None and arm.offloaded else "-"
    result.policies = arm.policies if arm is not None else policies_of(stock)
    return result


def run_with_offload_fallback(stock, docs, ref, options, packed=True) -> tuple[ArmResult, str]:
    """The arm with offload; if offload refuses the model, again without it (offload then 'off')."""
    result = run_arm(stock, docs, ref, options, packed=packed)
    if result.status == "refused" and isinstance(refusal_in(result.error), UnsupportedCheckpointing):
        note = "off (" + result.detail.split(": ", 1)[-1][:80] + ")"
        return run_arm(stock, docs, ref, options, packed=packed, offload=False), note
    return result, ""


__all__ = [
    "ArmResult",
    "Verdict",
    "advice_of",
    "failed",
    "judged",
    "run_arm",
    "run_with_offload_fallback",
    "short",
    "where",
]
