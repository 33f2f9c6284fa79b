"""Fused RMSNorm and SwiGLU from ``torch.compile`` (inductor) where Liger's Triton kernels cannot run.

Why: on a CPU, a bf16 step of a small model spends a third of its time outside the matmuls, much
of it in RMSNorm (eight unfused passes forward and more backward, with two fp32 round trips)
and in the MLP's ``silu(gate) * up``. Inductor fuses each into one or two vectorised C++ loops.
Measured on SmolLM2-135M's shapes (2 threads, bf16, forward + backward, ``benchmarks/fused_kernels.py
--kernels``): RMSNorm 2.7-3.8x faster (~1.4 ms a call compiled, 61 calls a step), SwiGLU 1.3-1.6x
(30 a step); RoPE measured 0.8x and 1.3x in two runs and is left alone (taking it means swapping
the modeling module's function for every model of the type). On whole steps of the real model:
1.08-1.16x with the two arms' steps interleaved in one process, within noise across separate
processes, and a third less peak memory (the norms keep no fp32 copies for backward); see
BENCHMARKS.md, issue 20.

Exact or refused, per module class: a class is switched only when a probe finds its own forward
bit-identical to the stock formula the kernels compile (:func:`rms_norm_formula`,
:func:`swiglu_formula`), in the model's dtype, on random inputs and (for norms) a random weight.
So Gemma's ``(1 + weight)`` norm, a norm that casts after the multiply, or a GELU MLP keeps its
own forward, and the policy line names it. The compiled kernels differ from the eager formula
only by float rounding (what inductor fuses it computes in fp32), which the parity tests bound.

When: compiling costs a cold start (about 25 s on this CPU with an empty inductor cache, a few
seconds with a warm one), paid back after :data:`BREAK_EVEN_STEPS`. The compiled path runs only
while autograd records (training); evaluation and generation use the eager formula, so they
never compile another graph, and under a TorchDispatchMode (slipstream's host-sync counter, a
FakeTensorMode) the eager formula runs too: dynamo would skip the frame and mark the code
eager from then on.
"""

from __future__ import annotations

import copy
import inspect
import types
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import _get_current_dispatch_mode

from ..modes import eval_mode

# Optimizer steps after which the fused kernels have paid back their cold start, per device type.
# CPU: ~25 s cold start (empty inductor cache: 21.5 s for RMSNorm, the first compile of a process,
# plus 2.9 s for SwiGLU). The step gain on SmolLM2-135M in bf16 measured 1.08-1.16x with the two
# arms' steps interleaved in one process (~0.2 s a step: ~115 steps) but 1.00x [0.96, 1.04] across
# the A/B harness's separate processes, where this VM's 2x swings in matmul speed between
# processes drown it; at a 5% gain (0.08 s) the cold start pays back in ~300 steps, the threshold
# taken. CUDA: not measured (no GPU in these runs), so "auto" leaves it to Liger there.
BREAK_EVEN_STEPS: dict[str, int | None] = {"cpu": 300, "cuda": None}
BACKEND = "inductor"  # the tests swap in a cheaper backend to check the wiring


def rms_norm_formula(hidden: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' Llama-family RMSNorm: normalise in fp32, cast back, then scale."""
    hidden32 = hidden.to(torch.float32)
    hidden32 = hidden32 * torch.rsqrt(hidden32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * hidden32.to(hidden.dtype)


def swiglu_formula(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The gated MLP's activation: ``silu(gate_proj(x)) * up_proj(x)``."""
    return F.silu(gate) * up


class _Kernel:
    """A formula compiled once per process (dynamic shapes: one graph whatever the packed length),
    entered only while autograd records and no TorchDispatchMode is active."""

    def __init__(self, formula: Callable[..., torch.Tensor]):
        self.formula = formula
        self.compiled: Callable[..., torch.Tensor] | None = None
        self.backend: str | None = None

    def __call__(self, *args):
        if not torch.is_grad_enabled() or _get_current_dispatch_mode() is not None:
            return self.formula(*args)
        if self.compiled is None or self.backend != BACKEND:
            self.compiled = torch.compile(self.formula, dynamic=True, backend=BACKEND)
            self.backend = BACKEND
        return self.compiled(*args)


RMS_NORM = _Kernel(rms_norm_formula)
SWIGLU = _Kernel(swiglu_formula)


def _norm_eps(module: torch.nn.Module) -> float | None:
    for name in ("variance_epsilon", "eps"):
        value = getattr(module, name, None)
        if isinstance(value, float):
            return value
    return None


def _fused_rms_norm_forward(self, hidden_states):
    return RMS_NORM(hidden_states, self.weight, _norm_eps(self))


def _fused_swiglu_forward(self, x):
    return self.down_proj(SWIGLU(self.gate_proj(x), self.up_proj(x)))


def _is_norm_candidate(module: torch.nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    return (
        "rmsnorm" in type(module).__name__.lower()
        and isinstance(weight, torch.nn.Parameter)
        and weight.dim() == 1
        and _norm_eps(module) is not None
    )


def _is_mlp_candidate(module: torch.nn.Module) -> bool:
    return all(
        isinstance(getattr(module, name, None), torch.nn.Module)
        for name in ("gate_proj", "up_proj", "down_proj")
    ) and hasattr(module, "act_fn")


def _takes_one_input(module: torch.nn.Module) -> bool:
    """The class's forward takes exactly one argument (no gate, no optional extras, no ``*args``):
    the replacement has the same signature, so no caller can pass what it would drop."""
    try:
        parameters = list(inspect.signature(type(module).forward).parameters.values())[1:]  # less self
    except (TypeError, ValueError):
        return False
    return len(parameters) == 1 and parameters[0].kind in (
        inspect.Parameter.POSITIONAL_ONLY,
        inspect.Parameter.POSITIONAL_OR_KEYWORD,
    )


def _probe(module: torch.nn.Module, kind: str) -> str:
    """'' where ``module``'s class may take the kernel, else why not (never raises)."""
    if not _takes_one_input(module):
        return "its forward takes more than the hidden states"
    try:
        return _probe_norm(module) if kind == "norm" else _probe_mlp(module)
    except Exception as error:  # noqa: BLE001 - a forward the probe cannot run keeps its own forward
        return f"the probe could not run it ({type(error).__name__}: {error})"


def _probe_norm(module: torch.nn.Module) -> str:
    """'' when the class's forward is bit-identical to :func:`rms_norm_formula`, else why not.
    Runs on a copy (a norm is one vector) with a random weight, since a weight of ones would hide
    a ``(1 + weight)`` or a cast after the multiply, and in each pairing of fp32 / bf16 weights
    and inputs, since a cast order shows only where the two dtypes differ."""
    generator = torch.Generator(device="cpu").manual_seed(0)
    width = module.weight.shape[0]
    weight = torch.randn(width, generator=generator).mul_(0.5).add_(1.0)
    hidden = torch.randn(2, 3, width, generator=generator).mul_(3.0)
    dtypes = (torch.float32, torch.bfloat16)
    for weight_dtype in dtypes:
        probe = copy.deepcopy(module).to(weight_dtype)
        with torch.no_grad():
            probe.weight.copy_(weight)
            for hidden_dtype in dtypes:
                x = hidden.to(device=probe.weight.device, dtype=hidden_dtype)
                own = type(probe).forward(probe, x)
                ours = rms_norm_formula(x, probe.weight, _norm_eps(probe))
                if own.shape != ours.shape or own.dtype != ours.dtype or not torch.equal(own, ours):
                    return "its forward is not the Llama-style RMSNorm (weight * normalised input cast back)"
    return ""


def _in_features(linear: torch.nn.Module) -> int | None:
    value = getattr(linear, "in_features", None)
    if isinstance(value, int):
        return value
    weight = getattr(linear, "weight", None)
    return int(weight.shape[-1]) if isinstance(weight, torch.Tensor) and weight.dim() == 2 else None


def _probe_mlp(module: torch.nn.Module) -> str:
    """'' when the class's forward is bit-identical to ``down(silu(gate(x)) * up(x))``, else why
    not. Runs the live module (no copy of its weights) on three random tokens, in eval mode so an
    adapter's dropout cannot differ between the two calls."""
    width = _in_features(module.gate_proj)
    parameter = next(module.parameters(), None)
    if width is None or parameter is None:
        return "its input width could not be read from gate_proj"
    dtype = next((p.dtype for p in module.parameters() if p.is_floating_point()), torch.float32)
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        dtype = torch.bfloat16  # quantized bases (4-bit) take the compute dtype
    generator = torch.Generator(device="cpu").manual_seed(0)
    hidden = torch.randn(1, 3, width, generator=generator).to(device=parameter.device, dtype=dtype)
    with eval_mode(module), torch.no_grad():
        own = type(module).forward(module, hidden)
        ours = module.down_proj(swiglu_formula(module.gate_proj(hidden), module.up_proj(hidden)))
    if not isinstance(own, torch.Tensor) or own.shape != ours.shape or not torch.equal(own, ours):
        return "its forward is not down_proj(silu(gate_proj(x)) * up_proj(x))"
    return ""


@dataclass
class CompiledPlan:
    """The module classes whose forward becomes the compiled kernel, and those refused with why."""

    norms: dict[str, list[torch.nn.Module]] = field(default_factory=dict)  # class name: modules
    mlps: dict[str, list[torch.nn.Module]] = field(default_factory=dict)
    refused: dict[str, str] = field(default_factory=dict)  # class name: why it keeps its forward

    def describe(self) -> str:
        switched = [
            f"{kind} x{sum(map(len, found.values()))} ({', '.join(found)})"
            for kind, found in (("RMSNorm", self.norms), ("SwiGLU", self.mlps))
            if found
        ]
        text = "compiled (inductor: " + ("; ".join(switched) or "no module matched") + ")"
        if self.refused:
            text += "; kept their own forward: " + "; ".join(
                f"{name} ({why})" for name, why in self.refused.items()
            )
        return text


def compiled_plan(model: torch.nn.Module) -> CompiledPlan:
    """Probe each candidate class once (first instance) and list every module of the classes that pass."""
    plan = CompiledPlan()
    verdicts: dict[type, str] = {}
    for module in model.modules():
        kind = "norm" if _is_norm_candidate(module) else "mlp" if _is_mlp_candidate(module) else None
        if kind is None:
            continue
        name = type(module).__name__
        if "forward" in vars(module):  # another tool (an accelerate hook) owns this forward
            plan.refused[name] = "its forward is already replaced on the instance"
            continue
        if type(module) not in verdicts:
            verdicts[type(module)] = _probe(module, kind)
        why = verdicts[type(module)]
        if why:
            plan.refused[name] = why
        else:
            (plan.norms if kind == "norm" else plan.mlps).setdefault(name, []).append(module)
    return plan


def apply_compiled(plan: CompiledPlan) -> Callable[[], None]:
    """Each planned module's forward replaced on the instance; returns the undo."""
    switched: list[torch.nn.Module] = []
    for modules, forward in ((plan.norms, _fused_rms_norm_forward), (plan.mlps, _fused_swiglu_forward)):
        for group in modules.values():
            for module in group:
                module.forward = types.MethodType(forward, module)
                switched.append(module)

    def undo() -> None:
        for module in switched:
            vars(module).pop("forward", None)

    return undo


def compiled_policy(device: torch.device | str, mode: str, expected_steps: int | None) -> tuple[bool, str]:
    """Use the compiled kernels? ``(yes, why)``: "compiled" insists (where inductor can build);
    "auto" only on a device where the break-even is measured and the run is long enough."""
    from ..compile import UNKNOWN_STEPS, cold_start_pays_back, inductor_available

    kind = torch.device(device).type
    if mode == "compiled":
        ok, how = inductor_available(device)
        return ok, ("requested; " + how) if ok else how
    if mode != "auto":
        return False, "requested" if mode == "off" else ""
    break_even = BREAK_EVEN_STEPS.get(kind)
    if break_even is None:
        return False, f"compiled: no measured break-even on {kind} yet; fused_kernels='compiled' runs it"
    if expected_steps is None:
        return False, f"compiled: {UNKNOWN_STEPS}"
    pays, why = cold_start_pays_back(expected_steps, break_even, kind)
    if not pays:
        return False, f"compiled: {why}"
    ok, how = inductor_available(device)
    return (True, f"auto: {why}; {how}") if ok else (False, how)
