"""Doctor's decision rows: what each fast path would run on this device for the requested model,
and why.

Every decision comes from the library's own decider (``choose_backend``, ``GroupedLinear``,
``choose_policy``, ``choose_chunk_tokens``, ``resolve_dtype``, ``should_compile``); nothing is
re-derived here. The rows are :func:`decisions`' ``deciders``, one per path, in table order.
Compile has a decision row only (what "auto" does here, and whether inductor is installed for the
device): a cold compile takes tens of seconds on a CPU, too long for a check.
"""

from __future__ import annotations

import torch

from ..compile import BREAK_EVEN_STEPS, inductor_available, should_compile
from ..fused import compiled_plan, compiled_policy, liger_plan
from ..fused.compiled import BREAK_EVEN_STEPS as FUSED_BREAK_EVEN_STEPS
from ..loss import choose_chunk_tokens
from ..moe.experts import UnsupportedExperts, check_experts_module, experts_modules, is_moe_model
from ..moe.grouped import GroupedLinear
from ..offload.policy import DeviceDescription, choose_policy
from ..optimize import has_attention_sinks
from ..packing.attention import BACKEND_NAMES, choose_backend
from ..packing.costs import BUILTIN, AttentionCosts
from ..packing.grouping import grouping_policy
from ..packing.short_attention import short_kernel_policy
from .models import MOE_STAND_IN, CheckedModel, dtype_name, one_line

OFFLOAD_TOKENS = 8192  # the reload buffer offload sizes its second copy by (see enable_checkpointing)


def decisions(
    checked: CheckedModel,
    model: torch.nn.Module,
    moe_model: torch.nn.Module,
    device: torch.device,
    dtype: torch.dtype,
    dtype_why: str,
    costs: AttentionCosts = BUILTIN,
) -> list[dict[str, str]]:
    """What each fast path would run on ``device`` for ``checked`` and why, from the library's deciders.

    ``model``: the tiny model of the family (its structure: sinks, experts); ``moe_model``: the
    model the MoE check runs (the family's own or the stand-in); ``costs``: the packed attention's
    figures training would weigh here (``packing.calibration``)."""
    text = checked.config.get_text_config()

    def attention() -> tuple[str, str]:
        backend, why = choose_backend("auto", device, has_attention_sinks(model), dtype)
        return f"{backend} ({BACKEND_NAMES[backend]})", why

    def offload() -> tuple[str, str]:
        hidden = int(getattr(text, "hidden_size", 0) or 0)
        buffer_bytes = hidden * OFFLOAD_TOKENS * torch.empty((), dtype=dtype).element_size()
        policy = choose_policy("auto", DeviceDescription.detect(device), buffer_bytes)
        engine = "CudaEngine" if device.type == "cuda" else "RecordingEngine (CPU stand-in)"
        buffers = "pinned" if policy.pinned else "pageable"
        return f"{policy.mode}; {buffers} host buffers; engine {engine}", "; ".join(policy.reasons) or "-"

    def grouping() -> tuple[str, str]:
        backend, _ = choose_backend("auto", device, has_attention_sinks(model), dtype)
        return "auto", grouping_policy("auto", backend, has_attention_sinks(model), costs).removeprefix(
            "auto "
        )

    def short_kernel() -> tuple[str, str]:
        backend, _ = choose_backend("auto", device, has_attention_sinks(model), dtype)
        limit = costs.short_limit(dtype) if backend == "sdpa" and device.type == "cpu" else 0
        measured = costs.figures.get("short_kernel_speedup_by_length")
        figures = (
            "; its speedup over SDPA by document length: "
            + ", ".join(f"{length} {ratio:.2f}x" for length, ratio in measured.items())
            if measured
            else ""
        )
        if limit:
            return f"on up to {limit} tokens", short_kernel_policy(
                "auto", backend, costs, dtype
            ).removeprefix("auto (").removesuffix(")") + figures
        if backend != "sdpa":
            return "off", f"SDPA for every document: the {backend} backend attends the whole row in one call"
        if device.type != "cpu":
            return "off", f"SDPA for every document: a CPU kernel (here {device.type})"
        return "off", f"SDPA for every document: no length where it was faster ({costs.source}){figures}"

    def loss() -> tuple[str, str]:
        tokens, why = choose_chunk_tokens(int(text.vocab_size), dtype, device)
        return f"{tokens} tokens per chunk", why

    def fused_kernels() -> tuple[str, str]:
        plan, why = liger_plan(model, device, "auto")  # the tiny model: its config's model type
        if plan:
            return "liger", why
        return fused_compiled_decision(model, device, why.removeprefix("off (auto: ").removesuffix(")"))

    deciders = {
        "dtype": lambda: (dtype_name(dtype), dtype_why),
        "compile (auto)": lambda: compile_decision(device),
        "packed attention": attention,
        "attention grouping": grouping,
        "short-document kernel (auto)": short_kernel,
        "MoE routing": lambda: _moe_decision(checked, model, moe_model, device, dtype),
        "offload (checkpointing: auto)": offload,
        "chunked loss": loss,
        "fused kernels (auto)": fused_kernels,
    }
    rows = []
    for path, decide in deciders.items():
        try:
            choice, why = decide()
        except Exception as error:  # noqa: BLE001 - a decider that fails here is itself a finding
            choice, why = "undecided", f"the decider failed: {one_line(error)}"
        rows.append({"path": path, "choice": choice, "why": why})
    return rows


def compile_decision(device: torch.device) -> tuple[str, str]:
    """What ``compile="auto"`` does on ``device`` (it depends on the run's length, which doctor does
    not know) and whether inductor can compile here (what is installed; nothing is compiled)."""
    break_even = BREAK_EVEN_STEPS.get(device.type)
    choice = _by_run_length(break_even, "on")
    if break_even is None:
        _, why = should_compile("auto", 2**31, device)
        why = why.removeprefix("off (auto: ").removesuffix(")")
    else:
        why = (
            f"{break_even} steps pay back a compile's cold start on {device.type} (measured; "
            "slipstream.compile.should_compile); without a step count (plain optimize) it stays off"
        )
    works, how = inductor_available(device)
    choice += "" if works else "; compile='on' cannot run here"
    return choice, f"{why}; torch.compile: {how} (not compiled here: a cold compile takes tens of seconds)"


def _by_run_length(break_even: int | None, on: str) -> str:
    """What an "auto" gated by a measured break-even does, for a run of unknown length."""
    return (
        "off, whatever the run's length" if break_even is None else f"{on} from {break_even} steps, off below"
    )


def fused_compiled_decision(model: torch.nn.Module, device: torch.device, liger_why: str) -> tuple[str, str]:
    """Where Liger cannot run: what ``fused_kernels="auto"`` does with the compiled kernels (it
    depends on the run's length, which doctor does not know), which of the model's module classes
    the probe would switch, and whether inductor can build here (nothing is compiled)."""
    break_even = FUSED_BREAK_EVEN_STEPS.get(device.type)
    choice = _by_run_length(break_even, "compiled")
    if break_even is None:
        why = compiled_policy(device, "auto", 2**31)[1]
    else:
        why = f"{break_even} steps pay back the kernels' cold start on {device.type} (measured; slipstream.fused.compiled)"
    works, how = inductor_available(device)
    choice += "" if works else "; fused_kernels='compiled' cannot run here"
    return choice, f"Liger: {liger_why}; {why}; {compiled_plan(model).describe()}; {how}"


def _moe_decision(checked, model, moe_model, device, dtype) -> tuple[str, str]:
    modules = experts_modules(moe_model)
    where = "" if moe_model is model else f" (a tiny {MOE_STAND_IN}: {checked.family} has no experts)"
    if not is_moe_model(moe_model):
        return "-", f"{checked.family} has no experts"
    try:
        if not modules:
            raise UnsupportedExperts(
                f"{type(moe_model).__name__}'s experts do not use transformers' experts interface"
            )
        for module in modules:
            check_experts_module(module)
    except UnsupportedExperts as error:
        return "stock" + where, one_line(error)
    module = modules[0]
    first = getattr(module, "gate_up_proj" if module.has_gate else "up_proj", None)
    if getattr(module, "slipstream_nf4", None) is not None or not isinstance(first, torch.Tensor):
        path, why = "loop", "4-bit experts: chunked dequantization"
    else:
        hidden = moe_model.config.get_text_config().hidden_size
        x = torch.zeros(16, hidden, dtype=dtype, device=device)
        linear = GroupedLinear(x, first.detach().to(device=device, dtype=dtype), None, None, "auto")
        path, why = linear.path, linear.reason
        if path == "grouped_mm":
            why = f"grouped_mm runs {dtype_name(dtype)} experts on {device.type} (0 host syncs)"
        else:
            why += " (the loop path: one host read of the expert counts per layer)"
    return f"sorted, {path}{where}", why
