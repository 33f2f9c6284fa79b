"""Activation checkpointing: off, recompute, offload (the saved inputs on the host) or
offload-double (their reloads double-buffered ahead of the backward); ``auto`` chooses by the
device (``offload.choose_policy``). Left as it is unless asked for; ``SLIPSTREAM_CHECKPOINTING``
overrides it (said in the policy log)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ..offload import OFFLOAD_TOKENS, enable_checkpointing
from ..offload.policy import Checkpointing, DeviceDescription, choose_policy
from .base import ApplyContext, DecisionContext, Option, ParityCase, Speedup

ENV_CHECKPOINTING = "SLIPSTREAM_CHECKPOINTING"


@dataclass
class CheckpointingState:
    """The checkpointing mode running on a model (None: left as it is) and its offload manager."""

    mode: str | None = None
    offload_manager: Any = field(default=None, repr=False)


class ActivationCheckpointing(Speedup):
    name = "checkpointing"
    stage = 90  # last: it wraps the decoder layers as the other speedups left them
    options = (
        Option(
            "checkpointing",
            Checkpointing | None,
            None,
            "activation checkpointing: off, recompute, offload, offload-double or auto "
            f"(default: leave as is; {ENV_CHECKPOINTING} overrides)",
        ),
    )
    doctor_label = "offload (checkpointing: auto)"
    sweep_column = "offload"
    sweep_header = "offload"

    def apply(self, run: ApplyContext) -> None:
        state, mode = run.state, run.speedups.checkpointing
        if mode is None:
            return
        if run.environment_note:
            state.say(f"checkpointing: {run.environment_note}")
        own = state.of(CheckpointingState)
        policy, own.offload_manager = enable_checkpointing(run.base, mode)
        own.mode = policy.mode
        state.policies += [f"checkpointing: {reason}" for reason in policy.reasons]
        state.policies.append(f"checkpointing: {policy.mode}")

    def decide(self, context: DecisionContext) -> tuple[str, str]:
        device, dtype = context.device, context.dtype
        hidden = int(getattr(context.config.get_text_config(), "hidden_size", 0) or 0)  # the real model's
        buffer_bytes = hidden * OFFLOAD_TOKENS * torch.empty((), dtype=dtype).element_size()
        policy = choose_policy("auto", DeviceDescription.detect(device), buffer_bytes)
        engine = "CudaEngine" if device.type == "cuda" else "RecordingEngine (CPU stand-in)"
        buffers = "pinned" if policy.pinned else "pageable"
        return f"{policy.mode}; {buffers} host buffers; engine {engine}", "; ".join(policy.reasons) or "-"

    def sweep_cell(self, policies: list[str], moe: bool, offloaded: str) -> str:
        return offloaded  # the harness offloads the arm itself (RecordingEngine), or says why not

    def parity_cases(self) -> tuple[ParityCase, ...]:
        return (
            ParityCase(
                "offload-double",
                fast={},
                stock={},
                arms="offloaded checkpointing vs none",
                offload=True,
                sweep=False,  # the sweep's main arm offloads wherever the model checkpoints
            ),
        )
