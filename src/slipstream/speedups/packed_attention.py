"""Packed attention: each document of a packed row attends only to itself, from host-built metadata.

The model is inspected first (``packing.verdict``: refused naming the feature, or adapted: token
mixers per document, position offsets); transformers' attention interface then runs slipstream's
backend (varlen flash on CUDA, per-document SDPA elsewhere). A padded batch is refused by a
pre-hook rather than silently dropping its mask. Off: the model's own attention and ``use_cache``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ..loss import ChunkedLoss
from ..packing.attention import BACKEND_NAMES, AttentionBackend, choose_backend, register_attention_functions
from ..packing.batch import PACKED_BATCH_KWARG
from ..packing.guards import UnsupportedArchitecture, enter_forward, leave_forward
from ..packing.verdict import TRAIN_UNPACKED, apply_adaptations, architecture_verdict
from ..refusal import Refusal, optimize_call
from .base import ApplyContext, DecisionContext, Option, ParityCase, Speedup


def has_attention_sinks(model: torch.nn.Module) -> bool:
    return any(hasattr(module, "sinks") for module in model.modules())


CHUNKED_LOSS_ON = {"chunked_loss": True}  # what reads a prefix-shared batch's loss


class PackedInputRefused(Refusal, ValueError):
    """A batch the packed model cannot take exactly (a padding mask; prefix-shared rows on the stock loss)."""

    avoid = {"packed_attention": False}


def padding_guard(module, args, kwargs):
    """Forward pre-hook: a padded (2D-masked) batch cannot run on the packed attention.

    The packed backends take document boundaries from the PackedBatch; a padding mask would be
    silently dropped by transformers' mask builders, so refuse it instead. Only the unpacked
    path pays for this check (one sync), never a PackedBatch.
    """
    batch = kwargs.get(PACKED_BATCH_KWARG)
    if batch is not None:
        if (
            batch.loss_targets is not None
            and kwargs.get("labels") is not None
            and not isinstance(vars(module).get("_loss_function"), ChunkedLoss)
        ):
            raise PackedInputRefused(
                "this PackedBatch shares prefixes (slipstream.packing.collate_groups): its loss is read at "
                "batch.loss_positions / batch.loss_targets, which the stock loss (shifted labels) cannot "
                "express, so it would differ from the unshared rows' loss. Turn the chunked loss on "
                f"({optimize_call(CHUNKED_LOSS_ON)}, speedups.chunked_loss: true), or run the "
                "forward without labels and take slipstream.loss.packed_loss_from_logits(out.logits, batch), "
                "or collate_groups(..., prefix_sharing=False)",
                refused="prefix-shared rows on the stock loss",
                avoid=CHUNKED_LOSS_ON,
            )
        return None
    mask = kwargs.get("attention_mask")
    if isinstance(mask, torch.Tensor) and mask.dim() == 2 and not bool(mask.all()):
        raise PackedInputRefused(
            "this model runs slipstream's packed attention, which takes document boundaries from a "
            "PackedBatch (slipstream.collate_packed), not from a padding mask. Pack the batch, or call "
            f"{optimize_call(PackedInputRefused.avoid)} to go back to the stock attention.",
            refused="a padded batch on the packed attention",
        )
    return None


@dataclass
class PackedAttentionState:
    """What the packed attention installed on a model (``state.of(PackedAttentionState)``): the
    backend's attention name (None: stock), the padding guard and the attention guards' hooks, and
    the undo of the verdict's adaptations."""

    backend: str | None = None
    hook: Any = field(default=None, repr=False)
    guard_hooks: list = field(default_factory=list, repr=False)
    undo_adaptations: Any = field(default=None, repr=False)


class PackedAttention(Speedup):
    name = "packed attention"
    stage = 10
    options = (
        Option(
            "packed_attention",
            bool,
            True,
            "attend within each document of a packed batch from host-built metadata: no host syncs, "
            "no T x T mask (false: the model's stock attention)",
            stock=False,
        ),
        Option(
            "attention_backend",
            AttentionBackend,
            "auto",
            "packed attention kernel: auto (varlen flash on CUDA, per-document SDPA otherwise)",
        ),
    )
    ablation = {"packed_attention": False}
    ablation_name = "packed-attention"
    doctor_label = "packed attention"
    sweep_column = "packed attention"
    sweep_header = "packed"

    def apply(self, run: ApplyContext) -> None:
        base, state = run.base, run.state
        own = state.of(PackedAttentionState)
        if not run.speedups.packed_attention:
            run.facts["attention_backend"] = None
            if own.backend is not None:
                self._restore(base, state, own)
            return
        verdict = architecture_verdict(base)  # refuses what packed training cannot do exactly
        register_attention_functions()
        device, dtype = run.device, run.dtype
        backend, reason = choose_backend(
            run.speedups.attention_backend, device, has_attention_sinks(base), dtype
        )
        run.facts["attention_backend"] = backend
        name = BACKEND_NAMES[backend]
        if own.backend == name:
            return
        try:
            base.set_attn_implementation(name)
        except (ValueError, TypeError, NotImplementedError) as error:
            raise UnsupportedArchitecture(
                f"transformers refused slipstream's attention for {type(base).__name__} ({error}). {TRAIN_UNPACKED}"
            ) from error
        if base.config._attn_implementation != name:
            raise UnsupportedArchitecture(
                f"transformers refused attention implementation {name!r} for {type(base).__name__}. {TRAIN_UNPACKED}"
            )
        base.config.use_cache = False
        if own.hook is None:
            own.hook = base.register_forward_pre_hook(padding_guard, with_kwargs=True)
            own.guard_hooks = [  # the running forward's batch, for the attention guards
                base.register_forward_pre_hook(enter_forward, with_kwargs=True),
                base.register_forward_hook(leave_forward, with_kwargs=True, always_call=True),
            ]
        own.backend = name
        state.say(f"packed attention: {name} ({reason}); use_cache off")
        if own.undo_adaptations is None:
            own.undo_adaptations = apply_adaptations(base, verdict)
            for note in verdict.adaptations():
                state.say(f"packed attention: {note}")

    @staticmethod
    def _restore(base, state, own: PackedAttentionState) -> None:
        """The model's stock attention and ``use_cache`` back (the grouping and the short-document
        kernel forget their choices on their own: they run after this, with no backend)."""
        base.set_attn_implementation(state.stock_attn_implementation)
        if state.stock_use_cache is not None:
            base.config.use_cache = state.stock_use_cache
        if own.hook is not None:
            own.hook.remove()
            own.hook = None
            for handle in own.guard_hooks:
                handle.remove()
            own.guard_hooks = []
        if own.undo_adaptations is not None:
            own.undo_adaptations()
            own.undo_adaptations = None
        own.backend = None
        state.say(
            "packed attention: off (stock)",
            log=f"packed attention: off (stock {state.stock_attn_implementation})",
        )

    def decide(self, context: DecisionContext) -> tuple[str, str]:
        backend, why = choose_backend(
            "auto", context.device, has_attention_sinks(context.model), context.dtype
        )
        return f"{backend} ({BACKEND_NAMES[backend]})", why

    def sweep_cell(self, policies: list[str], moe: bool, offloaded: str) -> str:
        return "on" if any(line.startswith("packed attention: slipstream") for line in policies) else "off"

    def parity_cases(self) -> tuple[ParityCase, ...]:
        return (
            ParityCase(
                "packed attention",
                fast={"attention_grouping": "per_document"},
                stock={"packed_attention": False},
                arms="documents packed in one row vs each document alone (stock attention)",
                stock_layout="alone",
                sets_layout=True,
                sweep=False,  # the sweep's main arm is this check (every speedup on, packed)
            ),
        )
