"""``Speedups``: every toggle slipstream has, typed, validated once, from config to kernel.

Each speedup is one object in a module of its own (``speedups/<name>.py``, a ``Speedup``: its
options, stock values, apply / undo, policy lines, ``auto`` decision, parity cases and ablation
arm), listed in ``speedups.registry``. ``Speedups`` is the frozen dataclass of every registered
speedup's options, built from that list: ``slipstream.optimize(model, speedups=...)`` takes it;
the training config's ``speedups`` section *is* it; each A/B arm is a ``Speedups`` plus a batch
layout; the ``slipstream train`` config keys and the ``slipstream ab`` options are generated from
its fields. Adding a speedup is adding one module and registering it.

The only environment override, ``SLIPSTREAM_CHECKPOINTING``, is applied here
(:meth:`Speedups.with_environment`) and said in the returned note, never read elsewhere.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, get_args

from ..compile import CompileMode
from ..fields import check_fields
from ..fused import FusedKernels
from ..moe.experts import MoeCompute, MoeRouting
from ..offload.policy import Checkpointing
from ..packing.attention import AttentionBackend
from ..packing.grouping import AttentionGrouping
from ..packing.short_attention import ShortKernel
from . import registry
from .base import AblationRun, ApplyContext, DecisionContext, Option, ParityCase, Speedup
from .checkpointing import ENV_CHECKPOINTING

CHECKPOINTING_MODES: tuple[str, ...] = get_args(Checkpointing)


class _SpeedupsMethods:
    """The methods every built ``Speedups`` class carries (its fields come from the registry)."""

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


def build_speedups_class(speedups: tuple[Speedup, ...] | None = None) -> type:
    """The frozen dataclass of ``speedups``' options (the registered ones by default), in order.
    A test that registers a toy speedup builds its own and puts it where ``Speedups`` is read."""
    options = [
        option.dataclass_field()
        for speedup in speedups or registry.registered()
        for option in speedup.options
    ]
    namespace = {
        name: value
        for name, value in vars(_SpeedupsMethods).items()
        if not name.startswith("__") or name == "__post_init__"
    }
    namespace["__doc__"] = (
        "The speedups ``optimize`` switches on; every one has a stock arm (see each field's help)."
    )
    cls = dataclasses.make_dataclass("Speedups", options, namespace=namespace, frozen=True)
    cls.__module__ = __name__  # pickled by name: slipstream.speedups.Speedups
    return cls


Speedups = build_speedups_class()


def speedup_fields() -> list[dataclasses.Field]:
    """The fields, in order: what the CLIs generate their options from."""
    return list(dataclasses.fields(Speedups))


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
    "speedup_fields",
]
