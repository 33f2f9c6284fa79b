"""What every kind of A/B arm does alike in its process: :class:`ArmSession`, the frame of an arm's steps.

An arm is opened (``arm_result.open_arm_model``: the step driver for a slipstream arm, the arm's model
for a stock arm or a peer), then its planned steps run one at a time, each timed in the same frame (the
machine's share, the step-0 gradient, the curves). What a kind of arm adds: ``arm_run.RowsArmSession``
(SFT and preference pairs) and ``grpo_arms.GrpoArmSession`` (online RL).
"""

from __future__ import annotations

import dataclasses
import resource
from typing import Any

import torch

from .. import hardware
from ..optimize import base_model, state_of
from ..utilisation import flop_profile
from .ab_config import ABConfig
from .arm_result import ArmResult, open_arm_model, peak_memory_mb
from .arms import ARM_SPECS
from .step_gradient import HeldGradient


class ArmSession:
    """An arm set up in this process, ready to train its planned steps one at a time (see the module);
    what a kind of arm adds is :meth:`_set_up` (before the clock's first step), :meth:`_prepare` (a
    step's inputs, untimed), :meth:`_timed_step` and :meth:`_record`."""

    def __init__(
        self,
        config: ABConfig,
        arm: str,
        plan: list,
        vocab_size: int,
        perturb: bool = False,
        *,
        fp32: bool = False,
        gradient_dir: str | None = None,
    ):
        self.config, self.arm, self.plan, self.spec = config, arm, plan, ARM_SPECS[arm]
        self.device, self.driver, self.model, moved = open_arm_model(
            config, arm, plan, vocab_size, perturb, fp32
        )
        self.state = state_of(base_model(self.model))
        self.peer = self._open_peer()
        if self.peer is not None:
            self.state.policies.extend(self.peer.policies)
        self.profile = flop_profile(self.model)
        extra = self._set_up()
        if self.device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        self.result = ArmResult(
            arm=arm,
            memory_kind="cuda max allocated" if self.device == "cuda" else "cpu peak RSS",
            attn_implementation=base_model(self.model).config._attn_implementation,
            # the model's own list: first-step decisions join it
            policies=self.state.policies if self.state else [],
            dtype=str(next(self.model.parameters()).dtype).removeprefix("torch."),
            lr=[],
            perturbed_weights=moved,
            **{"activation_bytes": None, **extra},
        )
        # the step-0 gradient, for the fp32 truth of a reduced-precision run (bench/truth.py)
        self.gradient = HeldGradient(self.model, gradient_dir, arm)

    def _open_peer(self) -> Any:
        """The peer's trainer that steps this arm (``peers/trl_*.py``); None for any other arm."""
        return None

    def _set_up(self) -> dict[str, Any]:
        """The kind's own set-up (the driver's preparation, its probes); the ArmResult fields it fills."""
        raise NotImplementedError

    def _prepare(self, step: int) -> Any:
        """Step ``step``'s inputs, built before the clock starts."""
        raise NotImplementedError

    def _timed_step(self, step: int, prepared: Any) -> tuple[dict[str, Any], float]:
        """Run step ``step`` on the clock; its metrics (loss, grad_norm, lr, forward_s, backward_s) and seconds."""
        raise NotImplementedError

    def _record(self, step: int, metrics: dict[str, Any]) -> None:
        """What the kind keeps of a step beyond the curves every arm keeps."""

    def _after_figures(self) -> None:
        """What the kind measures after the figures (the optional profiled step)."""

    def _sync(self) -> None:
        if self.device == "cuda":
            torch.cuda.synchronize()

    def step(self, step: int) -> float:
        """Train planned step ``step`` (the next one); returns its time in seconds."""
        result = self.result
        if step != len(result.step_s):
            raise ValueError(f"{self.arm}: step {step} asked for, step {len(result.step_s)} is next")
        prepared = self._prepare(step)
        self._sync()
        usage = resource.getrusage(resource.RUSAGE_SELF)
        with hardware.other_load(torch.get_num_threads()) as load:
            metrics, seconds = self._timed_step(step, prepared)
        # what the machine did meanwhile: other work's cores, this process's page faults and kernel seconds
        result.other_cores.append(round(load.other_cores, 3) if load.known else None)
        after = resource.getrusage(resource.RUSAGE_SELF)
        result.page_faults.append(after.ru_minflt - usage.ru_minflt)
        result.system_s.append(round(after.ru_stime - usage.ru_stime, 4))
        result.step_s.append(seconds)
        if step == 0:  # written after the clock stopped
            result.step0_gradient = self.gradient.save()
        for key in ("forward_s", "backward_s", "loss", "grad_norm", "lr"):
            getattr(result, key).append(metrics[key])
        self._record(step, metrics)
        return seconds

    def finish(self) -> dict:
        """The arm's figures (after every step), as a dict."""
        self.result.peak_memory_mb = peak_memory_mb(self.device)
        self._after_figures()
        if self.peer is not None:
            self.peer.close()
        return dataclasses.asdict(self.result)
