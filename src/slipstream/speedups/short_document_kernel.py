"""The short-document kernel: on the per-document SDPA path, documents (or length groups) of up to
160 tokens attend by fp32 GEMMs with the softmax recomputed in backward; ``auto`` takes it on a CPU
in bf16 / fp16 up to the length this CPU's calibration found it faster than SDPA's flash kernel."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..packing.short_attention import SHORT_KERNEL_CHOICE, ShortKernel, short_kernel_policy
from .attention_grouping import choose_on_modules
from .base import AblationRun, ApplyContext, DecisionContext, Option, ParityCase, Speedup
from .packed_attention import has_attention_sinks


@dataclass
class ShortKernelState:
    """The short-document kernel's mode on a model (None while the packed attention is off)."""

    choice: str | None = None


class ShortDocumentKernel(Speedup):
    name = "short-document kernel"
    stage = 12
    options = (
        Option(
            "short_document_kernel",
            ShortKernel,
            "auto",
            "per-document SDPA path: documents (or length groups) of up to 160 tokens attend by fp32 GEMMs "
            "and softmax recomputed in backward; auto: on a CPU in bf16 / fp16, measured 1.2-3.6x faster "
            "there than SDPA's CPU flash kernel; on: every device and dtype; off: SDPA for every document",
            stock="off",
        ),
    )
    ablation = {"short_document_kernel": "off"}
    ablation_name = "short-kernel"
    doctor_label = "short-document kernel (auto)"

    def apply(self, run: ApplyContext) -> None:
        wanted = run.speedups.short_document_kernel
        costs = choose_on_modules(run, run.state.of(ShortKernelState), wanted, SHORT_KERNEL_CHOICE)
        if costs is not None:
            line = short_kernel_policy(wanted, run.facts["attention_backend"], costs, run.dtype)
            run.state.say(f"short-document kernel: {line}")

    def ablation_applies(self, run: AblationRun) -> bool:
        """A CPU kernel: on another device, or where this CPU's calibration found no length it is
        faster at in the run's dtype, the arm would run the same thing as ``slipstream``."""
        if run.device != "cpu":
            return False
        mode = run.speedups.short_document_kernel
        if mode != "auto":
            return mode == "on"
        from ..packing.calibration import attention_costs as measured  # once per device, dtype, threads

        dtype = getattr(torch, run.config.train.model.dtype)
        return measured(torch.device("cpu"), dtype, run.config.ab.threads).short_limit(dtype) > 0

    def decide(self, context: DecisionContext) -> tuple[str, str]:
        from ..packing.attention import choose_backend

        device, dtype, costs = context.device, context.dtype, context.costs
        backend, _ = choose_backend("auto", device, has_attention_sinks(context.model), dtype)
        limit = costs.short_limit(dtype) if backend == "sdpa" and device.type == "cpu" else 0
        measured = costs.figures.get("short_kernel_speedup_by_length")
        figures = (
            "; its speedup over SDPA by document length: "
            + ", ".join(f"{length} {ratio:.2f}x" for length, ratio in measured.items())
            if measured
            else ""
        )
        if limit:
            policy = short_kernel_policy("auto", backend, costs, dtype)
            return f"on up to {limit} tokens", policy.removeprefix("auto (").removesuffix(")") + figures
        if backend != "sdpa":
            return "off", f"SDPA for every document: the {backend} backend attends the whole row in one call"
        if device.type != "cpu":
            return "off", f"SDPA for every document: a CPU kernel (here {device.type})"
        return "off", f"SDPA for every document: no length where it was faster ({costs.source}){figures}"

    def parity_cases(self) -> tuple[ParityCase, ...]:
        return (
            ParityCase(  # forced on (fp32 here, where "auto" keeps SDPA) over right-padded groups
                "short kernel",
                fast={"attention_grouping": "grouped", "short_document_kernel": "on"},
                stock={"packed_attention": False},
                arms="documents of up to 160 tokens by the short kernel, grouped, vs each document alone",
                packed_only=True,
                stock_layout="alone",
                doctor=False,
                header="short",
            ),
        )
