"""Doctor's arm: the parity kit's arm (:class:`slipstream.parity.Arm`) on the device, in the dtype
training would use, with what doctor reads off it besides parity: the policy log ``optimize``
wrote, the offload engine's copies, and a second, counted step (host syncs; on CUDA the
synchronizing calls ``torch.cuda.set_sync_debug_mode("warn")`` reports)."""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from ..bench.counters import HostSyncCounter
from ..offload import CudaEngine, RecordingEngine
from ..parity import Arm, Step, train_step
from ..speedups import Speedups


@dataclass
class ArmRun(Step):
    """One arm's step (loss, gradients) and what doctor counted on it."""

    syncs: int | None = None
    syncs_by_op: dict[str, int] = field(default_factory=dict)
    cuda_sync_warnings: int | None = None
    policies: list[str] = field(default_factory=list)
    log: list[str] = field(default_factory=list)
    copies: dict[str, int] = field(default_factory=dict)


class _CountingEngine:
    """The offload engine it wraps (CudaEngine or RecordingEngine), counting the copies it issues."""

    def __init__(self, engine):
        self._engine = engine
        self.copies: Counter[str] = Counter()

    def copy(self, dst, src, stream, what: str) -> None:
        self.copies["offloads" if what.startswith("offload") else "reloads"] += 1
        self._engine.copy(dst, src, stream, what)

    def __getattr__(self, name: str):
        return getattr(self._engine, name)


class _ListHandler(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@contextlib.contextmanager
def _captured_log() -> Iterator[list[str]]:
    """slipstream's policy log lines while active (shown as well only if the user asked for -v)."""
    logger = logging.getLogger("slipstream")
    handler = _ListHandler()
    level, propagate = logger.level, logger.propagate
    if not logger.isEnabledFor(logging.INFO):
        logger.setLevel(logging.INFO)
        logger.propagate = False
    logger.addHandler(handler)
    try:
        yield handler.lines
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        logger.propagate = propagate


@contextlib.contextmanager
def _cuda_sync_warnings(device: torch.device) -> Iterator[list]:
    """On CUDA: torch.cuda.set_sync_debug_mode("warn") while active; the warnings it raised."""
    if device.type != "cuda":
        yield []
        return
    previous = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield caught
        finally:
            torch.cuda.set_sync_debug_mode(previous)


def run_arm(
    base: torch.nn.Module,
    docs: list[list[int]],
    speedups: Speedups,
    layout: str,
    device: torch.device,
    dtype: torch.dtype,
    offload: bool = False,
    count: bool = True,
    lora: bool = False,
) -> ArmRun:
    """One training step of a copy of ``base`` under ``speedups`` (parity), then another that is
    counted (host syncs; on CUDA the sync-debug warnings too). ``lora``: a PEFT LoRA on every linear
    layer trains instead of the whole model (the same adapter in every arm)."""
    arm = Arm(base, device, dtype)
    engine = None
    if offload:  # the real engine on a GPU; elsewhere the same schedule on the CPU stand-in
        engine = _CountingEngine(CudaEngine(device) if device.type == "cuda" else RecordingEngine())
    with _captured_log() as log:
        arm.set_up(speedups, wrap=_with_lora if lora else None, offload=engine)
        step = arm.step(docs, layout, seed=0)
        run = ArmRun(step.loss, step.grads, inputs=step.inputs)
        if engine is not None:
            run.copies = dict(engine.copies)
        if count:
            arm.model.zero_grad(set_to_none=True)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            with HostSyncCounter() as syncs, _cuda_sync_warnings(device) as warned:
                train_step(arm.model, step.inputs, layout)
            run.syncs, run.syncs_by_op = syncs.total, dict(syncs.by_op)
            if device.type == "cuda":
                run.cuda_sync_warnings = sum("synchroniz" in str(w.message).lower() for w in warned)
    run.policies = arm.policies
    run.log = log
    return run


def _with_lora(model: torch.nn.Module) -> torch.nn.Module:
    """PEFT LoRA (rank 4) on every linear layer but the head, seeded, with B drawn (not PEFT's zeros)
    so the adapters' own gradients and outputs are compared too."""
    from peft import LoraConfig, get_peft_model  # only the LoRA check imports it

    torch.manual_seed(0)
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    generator = torch.Generator().manual_seed(1)
    for name, parameter in model.named_parameters():
        if "lora_B" in name:
            parameter.data.copy_(torch.randn(parameter.shape, generator=generator) * 0.05)
    return model
