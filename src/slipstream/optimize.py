"""``slipstream.optimize``: switch a transformers model onto slipstream's fast paths, in place.

Every speedup is a toggle whose other arm is the stock path, so the A/B harness can compare
them and the tests can prove they compute the same thing. Calling ``optimize`` again with a
toggle off restores the stock behaviour.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from .speedups import ApplyContext, Speedups, registry
from .speedups.attention_grouping import AttentionGroupingState
from .speedups.checkpointing import CheckpointingState
from .speedups.chunked_loss import ChunkedLossState
from .speedups.compile import CompileState
from .speedups.fused_kernels import FusedKernelsState
from .speedups.packed_attention import PackedAttentionState

logger = logging.getLogger("slipstream")

_STATE_ATTR = "slipstream"  # the one attribute slipstream puts on a model: its OptimizeState


T = TypeVar("T")


def _state_field(kind: type, name: str) -> property:
    """A read-only property of ``OptimizeState``: field ``name`` of its speedup state ``kind``."""
    return property(lambda state: getattr(state.of(kind), name))


@dataclass
class OptimizeState:
    """Everything slipstream attached to a model (``model.slipstream``): the model's stock config,
    each speedup's own state (``of``: one object per speedup, its class in the speedup's module,
    ``speedups/<name>.py``), the policy log; :meth:`undo` puts the model back. The properties below
    read the built-in speedups' states under the names callers have always used."""

    stock_attn_implementation: str | None
    stock_use_cache: bool | None
    stock_experts_implementation: str | None = None
    policies: list[str] = field(default_factory=list)
    model: object | None = field(default=None, repr=False)  # the transformers model it belongs to
    states: dict[type, Any] = field(default_factory=dict)  # each speedup's state, by its class
    extras: dict[str, object] = field(default_factory=dict, repr=False)  # a plug-in speedup's own state

    def of(self, kind: type[T]) -> T:
        """The state of class ``kind`` (a speedup's), made empty on first use."""
        found = self.states.get(kind)
        if found is None:
            found = self.states[kind] = kind()
        return found

    packed_attention = _state_field(PackedAttentionState, "backend")  # its backend's name; None: stock
    # what the packed SDPA path's "auto" choices weigh (measured on a CPU, else built in)
    attention_costs = _state_field(AttentionGroupingState, "costs")
    # batches and attention calls the packed SDPA path ran grouped / per document
    grouping_counts = _state_field(AttentionGroupingState, "counts")
    chunked_loss = _state_field(ChunkedLossState, "loss")  # the installed loss.ChunkedLoss; None: stock
    checkpointing = _state_field(CheckpointingState, "mode")  # the mode running; None: untouched
    offload_manager = _state_field(CheckpointingState, "offload_manager")
    compiled = _state_field(CompileState, "compiled")  # whether the decoder layers run compiled
    fused_kernels = _state_field(FusedKernelsState, "kind")  # "liger" / "compiled"; None: stock

    def say(self, policy: str, log: str | None = None) -> None:
        """A decision: into the policy log and the ``slipstream`` logger (``log``: its wording there)."""
        self.policies.append(policy)
        logger.info(log or policy)

    def undo(self) -> None:
        """Every speedup back to its stock arm, the hooks removed, and this state detached."""
        model = self.model
        from . import speedups as speedups_module

        stock = speedups_module.Speedups.stock()
        optimize(model, stock.replace(checkpointing="off") if self.checkpointing is not None else stock)
        if getattr(model, _STATE_ATTR, None) is self:
            delattr(model, _STATE_ATTR)


def state_of(model: torch.nn.Module) -> OptimizeState | None:
    """The slipstream state of ``model`` (through a PEFT wrapper), or None if never optimized."""
    return getattr(base_model(model), _STATE_ATTR, None)


def base_model(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model under a PEFT wrapper (or the model itself). (A DDP / FSDP wrapper is
    ``train.distributed.unwrap``'s: that one keeps the adapters' wrapper.)"""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def optimize(
    model: torch.nn.Module,
    speedups: Speedups | None = None,
    *,
    expected_steps: int | None = None,
    **options: Any,
) -> torch.nn.Module:
    """Turn slipstream's optimizations on (or off) for ``model``, in place; returns the same model.

    ``speedups``: a :class:`slipstream.Speedups` (every toggle, typed and validated once; each
    field's help says what it does, docs/speedups.md more). ``**options`` are its fields by name, a
    convenience: ``optimize(model, packed_attention=False)`` is ``optimize(model,
    Speedups(packed_attention=False))``, and with both given the options replace those fields.
    ``expected_steps``: the run's optimizer steps (the trainer and ``slipstream ab`` pass them),
    what ``compile`` and ``fused_kernels`` "auto" weigh a cold start against; without them
    ``compile: auto`` stays off.

    Packed attention inspects the model first (:mod:`slipstream.packing.verdict`): refused with an
    error naming the feature, or adapted, each logged. Training with packed batches needs
    ``use_cache`` off (a cache lets packed documents see each other in stock transformers);
    ``optimize`` turns it off and restores it when undone. Each choice is logged once and kept in
    the model's state (``slipstream.state_of(model)``).
    """
    from . import speedups as speedups_module  # read at call time: a registered plug-in's options count

    cls = speedups_module.Speedups
    unknown = sorted(set(options) - {f.name for f in dataclasses.fields(cls)})
    if unknown:
        raise TypeError(
            f"optimize() got unknown option(s) {unknown}; the speedups are the fields of Speedups"
        )
    speedups = (speedups or cls()).replace(**options) if options else (speedups or cls())
    speedups, environment_note = speedups.with_environment()
    base = base_model(model)
    state: OptimizeState | None = getattr(base, _STATE_ATTR, None)
    if state is None:
        state = OptimizeState(
            stock_attn_implementation=base.config._attn_implementation,
            stock_use_cache=getattr(base.config, "use_cache", None),
            stock_experts_implementation=getattr(base.config, "_experts_implementation", None),
            model=base,
        )
        setattr(base, _STATE_ATTR, state)
    run = ApplyContext(base, state, speedups, expected_steps, environment_note)
    for speedup in registry.in_stage_order():
        speedup.apply(run)
    return model
