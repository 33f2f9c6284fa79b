"""Activation checkpointing: off, recompute, offload (one reload buffer), offload-double (two, prefetched).

``enable_checkpointing`` installs the chosen mode as the gradient-checkpointing function of
every transformers ``GradientCheckpointingLayer`` of a model; ``choose_policy`` decides what
"auto" (and what the device allows) means, with a reason for every decision.
"""

from __future__ import annotations

import logging

import torch

from ..packing.guards import bind_running
from ..packing.verdict import decoder_layers as checkpointing_layers  # the layers transformers checkpoints
from ..refusal import optimize_call
from .accounting import device_activation_bytes
from .checkpoint import OffloadManager, UnsupportedCheckpointing
from .engine import CudaEngine, RecordingEngine
from .policy import MODES, CheckpointPolicy, DeviceDescription, choose_policy

logger = logging.getLogger("slipstream")

_LEAVE_AS_IS = {"checkpointing": None}  # the Speedups default: the model's checkpointing untouched
OFFLOAD_TOKENS = 8192  # the tokens one reload buffer is sized for (offload-double's second one must fit)

__all__ = [
    "MODES",
    "OFFLOAD_TOKENS",
    "CheckpointPolicy",
    "CudaEngine",
    "DeviceDescription",
    "OffloadManager",
    "RecordingEngine",
    "UnsupportedCheckpointing",
    "checkpointing_layers",
    "choose_policy",
    "device_activation_bytes",
    "enable_checkpointing",
]


def _recompute(function, *args, **kwargs):
    """Per-layer activation checkpointing whose recompute sees the same packed batch as its forward."""
    return torch.utils.checkpoint.checkpoint(bind_running(function), *args, use_reentrant=False, **kwargs)


def enable_checkpointing(
    model: torch.nn.Module,
    mode: str = "auto",
    device: DeviceDescription | None = None,
    engine=None,
    min_offload_bytes: int = 1 << 20,
) -> tuple[CheckpointPolicy, OffloadManager | None]:
    """Install checkpointing ``mode`` on every decoder layer; returns the policy and the offload manager.

    ``device`` and ``engine`` are injectable (tests drive the offload schedule on a CPU with a
    ``RecordingEngine``; passing an engine forces the offload modes to run on it).
    """
    layers = checkpointing_layers(model)
    if not layers:
        raise UnsupportedCheckpointing(
            f"{type(model).__name__} has no transformers GradientCheckpointingLayer to checkpoint. "
            f"Use {optimize_call(_LEAVE_AS_IS)} (leave its checkpointing as it is)",
            refused=f"checkpointing {type(model).__name__}, which has no checkpointable layers",
            avoid=_LEAVE_AS_IS,
        )
    parameter = next(model.parameters())
    if device is None:
        device = DeviceDescription.detect(parameter.device)
        if engine is not None:  # an injected engine stands in for the streams
            device = DeviceDescription(has_cuda=True, name="injected engine", free_bytes=1 << 62)
    hidden = getattr(model.config, "hidden_size", 0)
    buffer_bytes = hidden * OFFLOAD_TOKENS * parameter.element_size()
    policy = choose_policy(mode, device, buffer_bytes)
    manager = None
    for layer in layers:
        layer.gradient_checkpointing = policy.mode != "off"
    if policy.mode == "recompute":
        for layer in layers:
            layer._gradient_checkpointing_func = _recompute
    elif policy.mode.startswith("offload"):
        engine = engine or CudaEngine(parameter.device)
        manager = OffloadManager(
            len(layers), policy.mode == "offload-double", engine, policy.pinned, min_offload_bytes
        )
        for index, layer in enumerate(layers):
            layer._gradient_checkpointing_func = manager.checkpoint_function(index)
    for reason in policy.reasons:
        logger.info("checkpointing: %s", reason)
    logger.info("checkpointing: %s on %d layers", policy.mode, len(layers))
    return policy, manager
