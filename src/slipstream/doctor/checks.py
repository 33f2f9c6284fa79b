"""Doctor's checks: each fast path against its stock arm, one training step on a tiny random model
of the requested family, judged on the parity kit (:mod:`slipstream.parity`).

Each path is checked on its own: its fast arm is the model as ``slipstream.optimize`` sets it up
by default (every path on where the model allows it), its stock arm differs in that one path
only, so a difference is that path's. The paths are the registered speedups' parity cases
(``ParityCase.doctor``; each case's ``arms`` says what it compares): MoE routing on the requested
family if it has experts, else on a tiny Qwen3-MoE; offload on the real ``CudaEngine`` on a GPU
and on the ``RecordingEngine`` (same schedule, copies at once) elsewhere.

Both arms train one step from the same weights in the dtype training would use; the loss and
every parameter gradient are compared. In fp32 the fast arm must match the stock arm within
the parity kit's tolerances. In bf16 both arms are also compared with an fp32 run of
the stock model (same bf16-rounded weights): the fast arm may be off by no more than
``BF16_FACTOR`` times the stock arm's own rounding error (or the fp32 tolerance where that is
larger). A second step of the fast arm counts host syncs (and, on CUDA, the syncs
``torch.cuda.set_sync_debug_mode("warn")`` reports); a path promises none, except the MoE loop
path's one read of the expert counts per layer per forward.
"""

from __future__ import annotations

import copy
import dataclasses
import re
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from ..bench.ablation import remembered as remembered_ablations
from ..models import build_model
from ..moe.experts import is_moe_model
from ..noise import quiet_transformers
from ..parity import LENGTHS, TOLERANCE, compare, documents
from ..parity import problems as beyond_tolerance
from ..refusal import Refusal
from ..speedups import ParityCase, Speedups, registry
from ..utilisation.peak import torch_threads
from .arm import ArmRun, run_arm
from .models import MOE_STAND_IN, CheckedModel, dtype_name, one_line

BF16_FACTOR = 4.0
# The least loss distance to fp32 a reduced-precision arm is allowed, whatever the stock arm's: an exact
# kernel that orders its fp32 sums otherwise flips a few bf16 roundings downstream, which moved the
# tiny model's loss by 1.3e-5 on an AVX2 CPU where stock bf16 SDPA sat 5.4e-7 from fp32 (its kernel is
# the fp32 one on rounded inputs there); a leak or a 1% loss error is 1e-2 and more.
LOW_PRECISION_LOSS_FLOOR = 1e-4
VERDICTS = ("ok", "WRONG", "refused", "skipped")


@dataclass
class Check:
    """One fast path's verdict on this device."""

    path: str
    verdict: str  # ok | WRONG | refused | skipped
    reason: str = ""
    model: str = ""
    arms: str = ""
    layout: str = ""  # "packed" (one row) or "alone" (one row per document)
    loss_error: float | None = None  # fast vs stock, relative
    grad_error: float | None = None  # the largest over the parameters
    worst_param: str | None = None
    bound: str = ""  # how parity was judged
    syncs: int | None = None  # fast arm, one step
    syncs_allowed: int | None = None  # None: no promise (unpacked layout)
    syncs_by_op: dict[str, int] = field(default_factory=dict)
    stock_syncs: int | None = None
    cuda_sync_warnings: int | None = None
    details: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Subject:
    """A model the checks run on: its fp32 weights, documents, and the layout its fast arms use."""

    label: str
    base: torch.nn.Module
    docs: list[list[int]]
    rounded: torch.nn.Module | None = None  # bf16 runs: fp32 copy of the bf16-rounded weights
    packs: bool = True  # False once packed attention is refused or wrong here: the others run unpacked

    @property
    def speedups(self) -> Speedups:
        # one SDPA call per document: the grouped path has its own check, so each check is one path's
        from .. import speedups as speedups_module  # read now: a speedup registered after import counts

        if self.packs:
            return speedups_module.Speedups(attention_grouping="per_document")
        return speedups_module.Speedups(packed_attention=False)

    @property
    def layout(self) -> str:
        return "packed" if self.packs else "alone"


def subject(label: str, base: torch.nn.Module, dtype: torch.dtype) -> Subject:
    base.train()
    rounded = copy.deepcopy(base).to(dtype).to(torch.float32) if dtype != torch.float32 else None
    return Subject(label, base, documents(base, lengths=LENGTHS), rounded)


def _reference_speedups(stock: Speedups) -> Speedups:
    """A stock arm's speedups for its fp32 reference run: packed attention (if on) per-document SDPA,
    the backend every device runs in fp32 (varlen flash kernels do not take fp32)."""
    return stock.replace(attention_backend="sdpa") if stock.packed_attention else stock


def _moe_loop_reads(log: list[str]) -> int:
    """Experts modules that ran the loop path (each reads its expert counts once per forward)."""
    return sum(1 for line in log if re.match(r"moe compute for .*: loop ", line))


def _judge_low_precision(check: Check, fast: ArmRun, stock: ArmRun, reference: ArmRun, dtype) -> list[str]:
    """bf16: the fast arm no further from fp32 than BF16_FACTOR x the stock arm, quantity by quantity."""
    fast_ref, stock_ref = compare(fast, reference), compare(stock, reference)
    loss_bound = max(BF16_FACTOR * stock_ref.loss, LOW_PRECISION_LOSS_FLOOR)
    ratios = {
        name: error / max(BF16_FACTOR * stock_ref.grads.get(name, 0.0), TOLERANCE["grad"])
        for name, error in fast_ref.grads.items()
    }
    worst = max(ratios, key=ratios.__getitem__, default=None)
    check.bound = (
        f"{dtype_name(dtype)}: <= {BF16_FACTOR:g}x the stock arm's distance to fp32 "
        f"(stock: loss {stock_ref.loss:.0e}, gradients <= {stock_ref.grad:.0e})"
    )
    check.details["vs_fp32"] = {
        "fast": {"loss": fast_ref.loss, "grad": fast_ref.grad, "worst_param": fast_ref.worst_param},
        "stock": {"loss": stock_ref.loss, "grad": stock_ref.grad, "worst_param": stock_ref.worst_param},
        "loss_bound": loss_bound,
        "worst_grad_ratio": ratios[worst] if worst else 0.0,
    }
    problems = []
    if not fast_ref.loss <= loss_bound:
        problems.append(f"loss off fp32 by {fast_ref.loss:.2g} (the stock arm's: {stock_ref.loss:.2g})")
    if worst and not ratios[worst] <= 1.0:
        problems.append(
            f"gradient of {worst} off fp32 by {fast_ref.grads[worst]:.2g} "
            f"(the stock arm's: {stock_ref.grads.get(worst, 0.0):.2g})"
        )
    return problems


def run_check(
    case: ParityCase,
    subject_: Subject,
    fast: dict[str, Any],
    device: torch.device,
    dtype: torch.dtype,
    arms: str,
    model: str,
) -> Check:
    """Run ``case``'s two arms on ``subject_`` (its speedups with ``fast`` / ``case.stock`` on top; the
    case's stock layout, offload and LoRA) and judge the fast arm (see the module docstring)."""
    started = time.perf_counter()
    check = Check(case.label, "ok", model=model or subject_.label, arms=arms, layout=subject_.layout)
    fast, stock = subject_.speedups.replace(**fast), subject_.speedups.replace(**case.stock)
    lora, offload = case.lora, case.offload
    stock_layout = case.stock_layout or subject_.layout
    try:
        stock_run = run_arm(subject_.base, subject_.docs, stock, stock_layout, device, dtype, lora=lora)
        reference = None
        if subject_.rounded is not None:
            reference = run_arm(
                subject_.rounded,
                subject_.docs,
                _reference_speedups(stock),
                stock_layout,
                device,
                torch.float32,
                count=False,
                lora=lora,
            )
    except Exception as error:  # noqa: BLE001 - the stock arm failing leaves nothing to compare with
        return _judged(check, started, "skipped", f"the stock arm cannot run here: {one_line(error)}")
    try:
        fast_run = run_arm(
            subject_.base, subject_.docs, fast, subject_.layout, device, dtype, offload=offload, lora=lora
        )
    except Refusal as error:  # a deliberate refusal (refusal.Refusal): said, not a fault
        return _judged(check, started, "refused", one_line(error))
    except Exception as error:  # noqa: BLE001 - a fast path that crashes on this device is broken here
        return _judged(check, started, "WRONG", f"crashed: {one_line(error)}")

    errors = compare(fast_run, stock_run)
    check.loss_error, check.grad_error, check.worst_param = errors.loss, errors.grad, errors.worst_param
    if reference is None:
        check.bound = f"fp32 vs stock: loss <= {TOLERANCE['loss']:g}, gradients <= {TOLERANCE['grad']:g}"
        problems = beyond_tolerance(errors, TOLERANCE)
    else:
        problems = _judge_low_precision(check, fast_run, stock_run, reference, dtype)

    check.syncs, check.syncs_by_op, check.stock_syncs = fast_run.syncs, fast_run.syncs_by_op, stock_run.syncs
    check.cuda_sync_warnings = fast_run.cuda_sync_warnings
    if subject_.layout == "packed":  # the promise is for packed batches (unpacked, positions are searched)
        forwards = 2 if offload else 1  # a checkpointed layer runs forward again in backward
        check.syncs_allowed = _moe_loop_reads(fast_run.log) * forwards
        if fast_run.syncs is not None and fast_run.syncs > check.syncs_allowed:
            problems.append(
                f"{fast_run.syncs} host syncs {fast_run.syncs_by_op} where {check.syncs_allowed} are promised"
            )
        if fast_run.cuda_sync_warnings and fast_run.cuda_sync_warnings > check.syncs_allowed:
            problems.append(
                f"set_sync_debug_mode('warn') reported {fast_run.cuda_sync_warnings} synchronizing calls"
            )
    check.details["policies"] = fast_run.policies
    check.details["log"] = fast_run.log
    if fast_run.copies:
        check.details["offload_copies"] = fast_run.copies
        if not fast_run.copies.get("offloads"):
            problems.append("the offload schedule copied nothing to the host")
    return _judged(check, started, "WRONG" if problems else "ok", "; ".join(problems))


def _judged(check: Check, started: float, verdict: str, reason: str) -> Check:
    """``check`` with its verdict, the reason for it, and the seconds since ``started``."""
    check.verdict, check.reason = verdict, reason
    check.seconds = time.perf_counter() - started
    return check


def check_paths(
    checked: CheckedModel,
    device: torch.device,
    dtype: torch.dtype,
    progress: Callable[[str], None] | None = None,
) -> tuple[list[Check], dict[str, Subject]]:
    """Every fast path against its stock arm on ``device``; also returns the models checked."""
    # The checks' models are tiny: one CPU thread runs them as fast, and never stalls on a core
    # another process holds (two OpenMP threads then wait on each other, 100x slower).
    with torch_threads(1), quiet_transformers():
        return _check_paths(checked, device, dtype, progress or (lambda text: None))


def _check_paths(
    checked: CheckedModel, device: torch.device, dtype: torch.dtype, say: Callable[[str], None]
) -> tuple[list[Check], dict[str, Subject]]:
    """One check per registered speedup's parity case (``ParityCase.doctor``), in registry order, then
    the ablation row. Each case's two arms are the subject's speedups with ``case.fast`` / ``case.stock``
    on top: per-document packed attention where the packed attention's own check (the case that
    ``sets_layout``) is ok here, else unpacked; a ``moe`` case on the family's experts or a stand-in's,
    a ``packed_only`` case on the packed row whatever the packed check found (the path is its own)."""
    main = subject(checked.asked, checked.build(0), dtype)
    moe = None
    checks = []
    engine = "CudaEngine" if device.type == "cuda" else "RecordingEngine: the CPU stand-in, same schedule"
    for case in (case for speedup in registry.registered() for case in speedup.parity_cases() if case.doctor):
        say(case.label)
        on, model, fast = main, "", dict(case.fast)
        if case.moe:
            if moe is None:
                if is_moe_model(main.base):
                    moe = main
                else:
                    built = build_model(MOE_STAND_IN, seed=0, attn_implementation="eager")
                    moe = subject(MOE_STAND_IN, built, dtype)
                    moe.packs = main.packs
            on = moe
            model = "" if moe is main else f"{MOE_STAND_IN} stand-in ({checked.family} has no experts)"
        elif case.packed_only:  # an option of the per-document SDPA path: on the packed row, that backend
            on, fast = dataclasses.replace(main, packs=True), {**fast, "attention_backend": "sdpa"}
        arms = f"{case.arms} ({engine})" if case.offload else case.arms
        check = run_check(case, on, fast, device, dtype, arms, model)
        checks.append(check)
        if case.sets_layout:  # the other paths run on top of packed attention only where it is right here
            main.packs = check.verdict == "ok"
    checks.append(ablation_check(device))
    return checks, {"main": main, "moe": moe if moe is not None else main}


def ablation_check(device: torch.device) -> Check:
    """Does ``auto`` hold here? The verdicts ``slipstream ab --preset ablation`` left for this device
    (``bench.ablation``): WRONG when an arm with a speedup off beat ``auto`` beyond the run's A/A noise,
    ok when every remembered run found none, skipped when no such run has been made here."""
    found = remembered_ablations(device)
    path, arms = "ablation", "slipstream (auto) vs each speedup off, in the last --preset ablation run"
    if not found:
        why = (
            "no --preset ablation run on this device yet (slipstream ab --preset ablation; "
            "doctor then reads its verdicts)"
        )
        return Check(path, "skipped", reason=why, arms=arms)
    beaten = []
    for workload, entry in found.items():
        for arm in entry["beats_auto"]:
            won = entry["arms"][arm]
            beaten.append(
                f"{arm} {won['ratio']:.2f}x [{won['low']:.2f}, {won['high']:.2f}] on {workload} "
                f"({entry['created'][:16]}; A/A noise {entry['noise_margin']:.1%})"
            )
    if beaten:
        why = "auto is beaten here beyond the noise: " + "; ".join(beaten) + "; set that speedup off"
        return Check(path, "WRONG", reason=why, arms=arms)
    runs = "; ".join(
        f"{workload}: {len(entry['arms']) - entry['a_a_control']} arms, A/A noise {entry['noise_margin']:.1%}"
        for workload, entry in found.items()
    )
    return Check(path, "ok", reason=f"no arm beats auto beyond the noise ({runs})", arms=arms)
