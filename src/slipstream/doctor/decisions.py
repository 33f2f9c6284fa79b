"""Doctor's decision rows: what each fast path would run on this device for the requested model,
and why.

The rows are the training dtype's, then one per registered speedup with a ``doctor_label``, in
registry order, each from its own ``Speedup.decide`` (which asks the library's own deciders:
``choose_backend``, ``GroupedLinear``, ``choose_policy``, ``choose_chunk_tokens``,
``should_compile``); nothing is re-derived here, and a speedup registered elsewhere has its row
with no edit. Compile has a decision row only (what "auto" does here, and whether inductor is
installed for the device): a cold compile takes tens of seconds on a CPU, too long for a check.
"""

from __future__ import annotations

import torch

from ..packing.costs import BUILTIN, AttentionCosts
from ..speedups import DecisionContext, registry
from ..speedups.compile import RegionalCompile
from .models import MOE_STAND_IN, CheckedModel, dtype_name, one_line


def decisions(
    checked: CheckedModel,
    model: torch.nn.Module,
    moe_model: torch.nn.Module,
    device: torch.device,
    dtype: torch.dtype,
    dtype_why: str,
    costs: AttentionCosts = BUILTIN,
) -> list[dict[str, str]]:
    """What each fast path would run on ``device`` for ``checked`` and why, from each speedup's decider.

    ``model``: the tiny model of the family (its structure: sinks, experts); ``moe_model``: the
    model the MoE check runs (the family's own or the stand-in); ``costs``: the packed attention's
    figures training would weigh here (``packing.calibration``)."""
    context = DecisionContext(
        checked.config, checked.family, model, moe_model, MOE_STAND_IN, device, dtype, costs
    )
    deciders = {"dtype": lambda: (dtype_name(dtype), dtype_why)}
    for speedup in registry.doctor_rows():
        deciders[speedup.doctor_label] = lambda speedup=speedup: speedup.decide(context)
    rows = []
    for path, decide in deciders.items():
        try:
            choice, why = decide()
        except Exception as error:  # noqa: BLE001 - a decider that fails here is itself a finding
            choice, why = "undecided", f"the decider failed: {one_line(error)}"
        rows.append({"path": path, "choice": choice, "why": why})
    return rows


def compile_decision(device: torch.device) -> tuple[str, str]:
    """What ``compile="auto"`` does on ``device`` (the compile speedup's own row)."""
    context = DecisionContext(None, "", None, None, MOE_STAND_IN, device, torch.float32, BUILTIN)
    return RegionalCompile().decide(context)


__all__ = ["compile_decision", "decisions"]
