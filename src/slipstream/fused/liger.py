"""Liger-Kernel's fused RMSNorm / SwiGLU / RoPE Triton kernels in place of the model's own.

``Speedups.fused_kernels``: "auto" (the default) uses them only where all of these hold, and
says which one did not otherwise: the model's parameters are on CUDA (Liger's kernels are
Triton), ``liger_kernel`` imports, and Liger has a per-model apply function for the model's
``config.model_type`` (its ``MODEL_TYPE_TO_APPLY_LIGER_FN``). "liger" insists and raises
:class:`FusedKernelsUnavailable` naming the reason; "off" is the stock path.

What is switched on, and why it stays exact on packed batches:

* ``rms_norm`` / ``layer_norm``: per-token normalisation; nothing crosses a token.
* ``swiglu`` / ``geglu``: the MLP's gate, per token. Left off on MoE models: Liger would bind
  its own experts forward, bypassing transformers' experts interface that slipstream's sorted
  routing plugs into.
* ``rope``: Liger's ``liger_rotary_pos_emb(q, k, cos, sin, ...)`` rotates each (row, position)
  by the ``cos``/``sin`` rows the model passes it (``ops/rope.py`` indexes them by batch and
  sequence index, ``position_ids`` unused), and the model's rotary module computes those from
  the batch's ``position_ids``, which restart at 0 for each packed document. So packed
  positions are exactly per document, as with the stock function.
* Never the loss: ``cross_entropy`` and ``fused_linear_cross_entropy`` are always passed
  False (slipstream's chunked loss owns the LM head and the loss). Any other switch an apply
  function offers is passed False too, and named in the policy line, until it is checked here.

Undo: Liger offers none, so :func:`apply_liger` records what its apply function changed and
returns a function that puts it back: every attribute it set on the model's modules (the
bound ``forward`` of each norm and MLP, the attributes those read) and every global of the
model's ``modeling_*`` module. Class swaps (``LlamaRMSNorm = LigerRMSNorm``) only change models
built later, so they are put back at once; the RoPE function swap is module-wide (the
attention looks it up at call time), so it stays while the kernels are on and affects any
model of the same type in the process; the A/B harness runs each arm in its own process.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import inspect
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import torch

from ..moe.experts import is_moe_model
from ..refusal import Refusal, optimize_call

FusedKernels = Literal["auto", "liger", "compiled", "off"]

MONKEY_PATCH = "liger_kernel.transformers.monkey_patch"
PIECES = ("rms_norm", "layer_norm", "swiglu", "geglu", "rope")  # per token or per position: exact packed
LOSS_PIECES = ("cross_entropy", "fused_linear_cross_entropy")  # slipstream's chunked loss owns the loss
EXPERT_PIECES = ("swiglu", "geglu")  # would bind over the experts' forward on MoE models
CUDA_ONLY = "Liger-Kernel's kernels are Triton, CUDA only"
INSTALL = "liger-kernel is not installed (pip install 'slipstream[liger]')"
_MISSING = object()


class FusedKernelsUnavailable(Refusal, ValueError):
    """``fused_kernels='liger'`` / ``'compiled'`` where they cannot run; the message names the reason."""

    avoid = {"fused_kernels": "auto"}  # on only where they run (and pay)


@dataclass(frozen=True)
class LigerPlan:
    """What :func:`apply_liger` passes Liger's per-model apply function, and what the policy says."""

    model_type: str
    version: str
    kwargs: dict[str, bool]  # every switch of the apply function, each explicitly on or off
    notes: tuple[str, ...] = field(default=())  # pieces left off and why

    @property
    def pieces(self) -> tuple[str, ...]:
        return tuple(name for name in PIECES if self.kwargs.get(name))


def _version() -> str:
    try:
        return importlib.metadata.version("liger-kernel")
    except importlib.metadata.PackageNotFoundError:
        return str(getattr(sys.modules.get("liger_kernel"), "__version__", "unknown version"))


def liger_available(device: torch.device | str, mode: str = "auto") -> tuple[bool, str]:
    """Could Liger run at all here (the device, the package)? ``(yes, why not)``; cheap: imports nothing."""
    if mode in ("off", "compiled"):
        return False, "requested" if mode == "off" else "compiled kernels requested instead"
    if mode not in ("auto", "liger"):
        raise ValueError(f"fused_kernels must be 'auto', 'liger', 'compiled' or 'off', got {mode!r}")
    kind = torch.device(device).type
    if kind != "cuda":
        return False, f"{kind} — {CUDA_ONLY}"
    if importlib.util.find_spec("liger_kernel") is None:
        return False, INSTALL
    return True, ""


def liger_plan(
    model: torch.nn.Module, device: torch.device | str, mode: str = "auto"
) -> tuple[LigerPlan | None, str]:
    """The decider: ``(plan, why)``, plan None where the kernels stay off (``why`` says why).

    ``model``: the transformers model (under any PEFT wrapper); ``device``: where its
    parameters are. "liger" raises :class:`FusedKernelsUnavailable` instead of returning None.
    """
    ok, why = liger_available(device, mode)
    plan, why = _plan_for(model) if ok else (None, why)
    if plan is None and mode == "liger":
        raise FusedKernelsUnavailable(
            f"fused_kernels='liger': {why}. Use {optimize_call(FusedKernelsUnavailable.avoid)} (on only where "
            "Liger can run), or fused_kernels='off'.",
            refused=f"fused_kernels='liger' ({why})",
        )
    if plan is None:
        return None, f"off ({'auto: ' if mode == 'auto' else ''}{why})"
    return plan, describe(plan)


def describe(plan: LigerPlan) -> str:
    said = [f"liger_kernel {plan.version}"] + list(plan.notes)
    return f"liger ({', '.join(plan.pieces) or 'no kernel offered'}; {'; '.join(said)})"


def _plan_for(model: torch.nn.Module) -> tuple[LigerPlan | None, str]:
    try:
        monkey_patch = importlib.import_module(MONKEY_PATCH)
    except Exception as error:  # noqa: BLE001 - any import failure (triton, transformers version) is a reason
        return None, f"liger_kernel does not import here ({type(error).__name__}: {error})"
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    apply_fn = getattr(monkey_patch, "MODEL_TYPE_TO_APPLY_LIGER_FN", {}).get(model_type)
    if apply_fn is None:
        return None, f"Liger-Kernel has no kernels for model type {model_type!r}"
    switches = [
        name
        for name, parameter in inspect.signature(apply_fn).parameters.items()
        if isinstance(parameter.default, bool)
    ]
    moe = is_moe_model(model)
    kwargs, notes = {}, []
    for name in switches:
        if name in LOSS_PIECES:
            kwargs[name] = False
        elif name in EXPERT_PIECES and moe:
            kwargs[name] = False
            notes.append(
                f"{name} left off: the MoE experts run transformers' experts interface (slipstream's routing)"
            )
        elif name in PIECES:
            kwargs[name] = True
        else:
            kwargs[name] = False
            notes.append(f"{name} left off: not checked by slipstream")
    notes.append("the loss stays slipstream's")
    if kwargs.get("rope"):
        notes.append("RoPE from the batch's per-document cos/sin, swapped module-wide while on")
    return LigerPlan(model_type, _version(), kwargs, tuple(notes)), ""


def apply_liger(model: torch.nn.Module, plan: LigerPlan) -> Callable[[], None]:
    """Liger's kernels on ``model`` (the transformers model, not a PEFT wrapper) as ``plan`` says;
    returns the undo, which puts back every module attribute and module global Liger changed."""
    monkey_patch = importlib.import_module(MONKEY_PATCH)
    modeling = sys.modules.get(type(model).__module__)
    globals_before = dict(vars(modeling)) if modeling is not None else {}
    modules = list(model.modules())
    attributes_before = [dict(vars(module)) for module in modules]

    monkey_patch._apply_liger_kernel_to_instance(model=model, **plan.kwargs)

    kept_globals: dict[str, object] = {}
    if modeling is not None:
        namespace = vars(modeling)
        for name, value in list(namespace.items()):
            old = globals_before.get(name, _MISSING)
            if old is value:
                continue
            if isinstance(value, type):  # a class swap: only models built later; put back now
                _restore(namespace, name, old)
            else:  # a function looked up at call time (RoPE): kept until undo
                kept_globals[name] = old
    changed_attributes = []
    for module, before in zip(modules, attributes_before, strict=True):
        after = vars(module)
        changed = {k: before.get(k, _MISSING) for k in after if before.get(k, _MISSING) is not after[k]}
        changed |= {k: v for k, v in before.items() if k not in after}
        if changed:
            changed_attributes.append((module, changed))

    def undo() -> None:
        for module, changed in changed_attributes:
            for name, old in changed.items():
                _restore(vars(module), name, old)
        if modeling is not None:
            for name, old in kept_globals.items():
                _restore(vars(modeling), name, old)

    return undo


def _restore(namespace: dict, name: str, old: object) -> None:
    if old is _MISSING:
        namespace.pop(name, None)
    else:
        namespace[name] = old
