"""``Speedups``: every toggle slipstream has, typed, validated once, from config to kernel.

One frozen dataclass holds each speedup and its choices. ``slipstream.optimize(model,
speedups=...)`` takes it; the training config's ``speedups`` section *is* it; each A/B arm is a
``Speedups`` plus a batch layout; the ``slipstream train`` config keys and the ``slipstream ab``
options are generated from its fields. Adding a speedup is adding one field here (with its
type, default and help) and reading it where the speedup is switched on.

The only environment override, ``SLIPSTREAM_CHECKPOINTING``, is applied here
(:meth:`Speedups.with_environment`) and said in the returned note, never read elsewhere.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Annotated, Any, get_args

from .compile import CompileMode
from .fields import Range, check_fields
from .fused import FusedKernels
from .moe.experts import MoeCompute, MoeRouting
from .offload.policy import Checkpointing
from .packing.attention import AttentionBackend
from .packing.grouping import AttentionGrouping
from .packing.short_attention import ShortKernel

CHECKPOINTING_MODES: tuple[str, ...] = get_args(Checkpointing)
ENV_CHECKPOINTING = "SLIPSTREAM_CHECKPOINTING"


def _help(text: str) -> dict[str, str]:
    return {"help": text}


@dataclass(frozen=True)
class Speedups:
    """The speedups ``optimize`` switches on; every one has a stock arm (see each field's help)."""

    packed_attention: bool = field(
        default=True,
        metadata=_help(
            "attend within each document of a packed batch from host-built metadata: no host syncs, "
            "no T x T mask (false: the model's stock attention)"
        ),
    )
    attention_backend: AttentionBackend = field(
        default="auto",
        metadata=_help("packed attention kernel: auto (varlen flash on CUDA, per-document SDPA otherwise)"),
    )
    attention_grouping: AttentionGrouping = field(
        default="auto",
        metadata=_help(
            "per-document SDPA path: documents of similar length share one batched call, right-padded "
            "(grouped), or one call each (per_document); auto: grouped where a cost model measured on a "
            "CPU (calls, padded score FLOPs, the gather) says it is cheaper"
        ),
    )
    short_document_kernel: ShortKernel = field(
        default="auto",
        metadata=_help(
            "per-document SDPA path: documents (or length groups) of up to 160 tokens attend by fp32 GEMMs "
            "and softmax recomputed in backward; auto: on a CPU in bf16 / fp16, measured 1.2-3.6x faster "
            "there than SDPA's CPU flash kernel; on: every device and dtype; off: SDPA for every document"
        ),
    )
    moe_routing: MoeRouting | None = field(
        default=None,
        metadata=_help(
            "MoE routing: sorted (argsort + counts, one grouped pass) or stock; default sorted where exact"
        ),
    )
    moe_compute: MoeCompute = field(
        default="auto", metadata=_help("sorted-routing expert compute: auto, grouped_mm or loop")
    )
    checkpointing: Checkpointing | None = field(
        default=None,
        metadata=_help(
            "activation checkpointing: off, recompute, offload, offload-double or auto "
            f"(default: leave as is; {ENV_CHECKPOINTING} overrides)"
        ),
    )
    chunked_loss: bool | None = field(
        default=None,
        metadata=_help(
            "LM head + cross-entropy a chunk of labelled tokens at a time (default: on where supported)"
        ),
    )
    loss_chunk_tokens: Annotated[int, Range(ge=1)] | None = field(
        default=None, metadata=_help("tokens per loss chunk (default: from a memory budget)")
    )
    lora_in_compute_dtype: bool = field(
        default=True,
        metadata=_help(
            "PEFT LoRA linears computed in the activations' dtype, the update added in one GEMM (fp32 "
            "adapters stay the optimizer's master copy): no activation casts per call (false: PEFT's forward)"
        ),
    )

    compile: CompileMode = field(
        default="auto",
        metadata=_help(
            "torch.compile each decoder layer (dynamic shapes, the packed attention left eager between graphs): "
            "on, off, or auto (on only when the run's steps pay back the compile's cold start)"
        ),
    )

    fused_kernels: FusedKernels = field(
        default="auto",
        metadata=_help(
            "fused RMSNorm / SwiGLU (/ RoPE) in place of the model's own modules (never its loss): liger "
            "(Liger-Kernel's Triton kernels, CUDA), compiled (inductor-compiled, each module class probed "
            "bit-exact to the stock formula first), auto (liger where it runs, else compiled where the run's "
            "steps pay back the cold start), off (the model's own modules); liger / compiled insist"
        ),
    )

    def __post_init__(self) -> None:
        check_fields(self)  # every rule, once: raises ConfigError naming the field

    def replace(self, **changes: Any) -> Speedups:
        return dataclasses.replace(self, **changes)

    @classmethod
    def stock(cls) -> Speedups:
        """Every speedup at its stock arm: the model as transformers and PEFT run it
        (checkpointing left as is). A new speedup adds its stock value here, once."""
        return cls(
            packed_attention=False,
            short_document_kernel="off",
            moe_routing="stock",
            chunked_loss=False,
            lora_in_compute_dtype=False,
            compile="off",
            fused_kernels="off",
        )

    def with_environment(self) -> tuple[Speedups, str | None]:
        """These speedups with ``SLIPSTREAM_CHECKPOINTING`` applied, and a note saying so (or None)."""
        override = os.environ.get(ENV_CHECKPOINTING)
        if not override:
            return self, None
        if override not in CHECKPOINTING_MODES:
            raise ValueError(
                f"{ENV_CHECKPOINTING}={override!r}: expected one of {', '.join(CHECKPOINTING_MODES)}"
            )
        note = f"checkpointing {override!r} from {ENV_CHECKPOINTING} (was {self.checkpointing!r})"
        return self.replace(checkpointing=override), note


def speedup_fields() -> list[dataclasses.Field]:
    """The fields, in order: what the CLIs generate their options from."""
    return list(dataclasses.fields(Speedups))


__all__ = [
    "CHECKPOINTING_MODES",
    "ENV_CHECKPOINTING",
    "AttentionBackend",
    "AttentionGrouping",
    "Checkpointing",
    "CompileMode",
    "FusedKernels",
    "MoeCompute",
    "MoeRouting",
    "Speedups",
    "speedup_fields",
]
