"""``Speedups``: every toggle slipstream has, typed, validated once, from config to kernel.

Each speedup is one object in a module of its own (``speedups/<name>.py``, a ``Speedup``: its
options, stock values, apply / undo, policy lines, ``auto`` decision, parity cases and ablation
arm), listed in ``speedups.registry``. ``Speedups`` is the frozen dataclass of the built-in
speedups' options, written out here so editors and type checkers see its fields; each field's
default and help come from its speedup's ``Option`` (one home), and ``tests/speedups`` checks that
the fields and the registry agree. ``slipstream.optimize(model, speedups=...)`` takes it; the
training config's ``speedups`` section *is* it; each A/B arm is a ``Speedups`` plus a batch
layout; the ``slipstream train`` config keys and the ``slipstream ab`` options are generated from
its fields.

Adding a built-in speedup is adding its module, registering it and writing its fields here. A
plug-in (a user's speedup, a test's toy) registers its ``Speedup`` and reads its toggles from
:func:`build_speedups_class`: a subclass of ``Speedups`` with the fields of every registered
option ``Speedups`` lacks (a hand-written ``@dataclass(frozen=True)`` subclass works the same);
the subclass goes where ``Speedups`` is read (``slipstream.speedups.Speedups``, and the
config's ``slipstream.train.config.Speedups``).

The only environment override, ``SLIPSTREAM_CHECKPOINTING``, is applied here
(:meth:`Speedups.with_environment`) and said in the returned note, never read elsewhere.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Annotated, Any, get_args

from ..compile import CompileMode
from ..fields import Range, check_fields
from ..fused import FusedKernels
from ..moe.experts import MoeCompute, MoeRouting
from ..offload.policy import Checkpointing
from ..packing.attention import AttentionBackend
from ..packing.grouping import AttentionGrouping
from ..packing.short_attention import ShortKernel
from . import registry
from .attention_grouping import AttentionGroupingSpeedup
from .base import AblationRun, ApplyContext, DecisionContext, Option, ParityCase, Speedup
from .checkpointing import ENV_CHECKPOINTING, ActivationCheckpointing
from .chunked_loss import ChunkedLossSpeedup
from .compile import RegionalCompile
from .fused_kernels import FusedKernelsSpeedup
from .lora_compute import LoraInComputeDtype
from .moe_routing import SortedMoeRouting
from .packed_attention import PackedAttention
from .short_document_kernel import ShortDocumentKernel

CHECKPOINTING_MODES: tuple[str, ...] = get_args(Checkpointing)


def _option(speedup: type[Speedup], name: str) -> Any:
    """The dataclass field of ``speedup``'s option ``name``: its default and help, from its module."""
    option = next(option for option in speedup.options if option.name == name)
    return option.dataclass_field()


@dataclass(frozen=True)
class Speedups:
    """The speedups ``optimize`` switches on; every one has a stock arm (see each field's help)."""

    packed_attention: bool = _option(PackedAttention, "packed_attention")
    attention_backend: AttentionBackend = _option(PackedAttention, "attention_backend")
    attention_grouping: AttentionGrouping = _option(AttentionGroupingSpeedup, "attention_grouping")
    short_document_kernel: ShortKernel = _option(ShortDocumentKernel, "short_document_kernel")
    moe_routing: MoeRouting | None = _option(SortedMoeRouting, "moe_routing")
    moe_compute: MoeCompute = _option(SortedMoeRouting, "moe_compute")
    chunked_loss: bool | None = _option(ChunkedLossSpeedup, "chunked_loss")
    loss_chunk_tokens: Annotated[int, Range(ge=1)] | None = _option(ChunkedLossSpeedup, "loss_chunk_tokens")
    checkpointing: Checkpointing | None = _option(ActivationCheckpointing, "checkpointing")
    lora_in_compute_dtype: bool = _option(LoraInComputeDtype, "lora_in_compute_dtype")
    compile: CompileMode = _option(RegionalCompile, "compile")
    fused_kernels: FusedKernels = _option(FusedKernelsSpeedup, "fused_kernels")

    def __post_init__(self) -> None:
        check_fields(self)  # every rule, once: raises ConfigError naming the field

    def replace(self, **changes: Any):
        return dataclasses.replace(self, **changes)

    @classmethod
    def stock(cls):
        """Every speedup at its stock arm: the model as transformers and PEFT run it (checkpointing
        left as is); each speedup declares its own stock values (``Option.stock``)."""
        names = {f.name for f in dataclasses.fields(cls)}
        values = {
            name: value
            for speedup in registry.registered()
            for name, value in speedup.stock_values().items()
            if name in names
        }
        return cls(**values)

    def with_environment(self):
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


def build_speedups_class(speedups: tuple[Speedup, ...] | None = None) -> type[Speedups]:
    """``Speedups`` with the options of ``speedups`` (the registered ones by default) that it lacks
    as fields of a subclass, in order: how a plug-in speedup gets its toggles without editing this
    module (``Speedups`` itself when there are none)."""
    names = {f.name for f in dataclasses.fields(Speedups)}
    added = [option for speedup in speedups or registry.registered() for option in speedup.options]
    added = [option for option in added if option.name not in names]
    if not added:
        return Speedups
    namespace: dict[str, Any] = {
        "__annotations__": {option.name: option.annotation for option in added},
        "__module__": __name__,
        "__qualname__": "Speedups",
        "__doc__": Speedups.__doc__,
    }
    for option in added:
        namespace[option.name] = option.dataclass_field()
    return dataclass(frozen=True)(type("Speedups", (Speedups,), namespace))


__all__ = [
    "CHECKPOINTING_MODES",
    "ENV_CHECKPOINTING",
    "AblationRun",
    "ApplyContext",
    "AttentionBackend",
    "AttentionGrouping",
    "Checkpointing",
    "CompileMode",
    "DecisionContext",
    "FusedKernels",
    "MoeCompute",
    "MoeRouting",
    "Option",
    "ParityCase",
    "ShortKernel",
    "Speedup",
    "Speedups",
    "build_speedups_class",
    "registry",
]
