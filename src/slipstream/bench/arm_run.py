"""One arm of an A/B, in the process it runs in: its model, its steps one at a time, its figures.

:func:`open_arm` builds the arm and returns its session (``arm_session.ArmSession``: an SFT or pair
arm's :class:`RowsArmSession`, a GRPO arm's ``grpo_arms.GrpoArmSession``), whose ``step`` trains one
planned step and whose ``finish`` returns the ``ArmResult``. :func:`run_arm` runs every step
in a row; the lockstep scheduler (``lockstep.py``) drives several sessions a step at a time.
"""

from __future__ import annotations

import contextlib
import importlib
import time
from typing import Any

import torch

from ..compile import graph_counts
from ..data.prefix_groups import unshared_tokens
from ..objectives.sharing import PrefixSharing, layout_documents
from ..offload import device_activation_bytes
from ..packing.pairs import counted_tokens, pair_documents
from ..train.step import train_step
from ..utilisation import docs_micro_batch, matmul_peak, profile_step
from .ab_config import ABConfig, resolve_device
from .arm_session import ArmSession
from .arms import ARM_SPECS, micro_batch_inputs, run_steps, train_config_of
from .counters import HostSyncCounter
from .host_pages import Held, WarmPages
from .inputs import ab_tokenizer
from .peers import TRL_PAIR_STEPS, PeerStep, PeerUnavailable
from .peers.trl_base import trainer_run


def trl_peer_step(config: ABConfig, arm: str, model: torch.nn.Module, device: str) -> PeerStep | None:
    """The TRL trainer that drives a ``trl`` / ``trl-dpo`` / ``trl-reward`` / ``trl-kto`` arm's steps
    (``peers/trl_step.py``, and the pair trainers of ``peers.TRL_PAIR_STEPS``), built on ``model`` for the run's workload; None
    for any other arm."""
    spec = ARM_SPECS[arm]
    if spec.peer != "trl":
        return None
    run = trainer_run(config)
    if spec.pairs == "peer":  # the trainer TRL has for the arm's objective (peers.TRL_PAIR_STEPS)
        module, name = TRL_PAIR_STEPS[spec.objective].split(":")
        step = getattr(importlib.import_module(f".peers.{module}", __package__), name)
        return step.for_run(model, ab_tokenizer(config), config.train, device=device, **run)
    from .peers.trl_step import TrlStep

    return TrlStep(model, ab_tokenizer(config), device=device, **run)


class RowsArmSession(ArmSession):
    """An SFT or preference-pair arm: each planned step's rows, through the step driver (a slipstream
    arm) or collated in a stock arm's or a TRL peer's own layout."""

    def _open_peer(self) -> PeerStep | None:
        return trl_peer_step(self.config, self.arm, self.model, self.device)

    def _set_up(self) -> dict[str, Any]:
        config, spec, plan = self.config, self.spec, self.plan
        self.warm_pages = WarmPages()
        self.last_plan = None  # the driver's last StepPlan (the profiled step runs it again)
        # The plan holds each step's rows whole, the same for every arm (peers included); every arm
        # counts the model FLOPs of the rows' shared layout (the start once): the work the rows need.
        mode = "off" if spec.pairs else config.train.data.share_prefixes
        sharing = PrefixSharing(mode, config.train.data.max_seq_len, config.train.seed)
        as_docs = pair_documents if spec.pairs else layout_documents if mode != "off" else (lambda docs: docs)
        model_flops = [
            self.profile.step_flops(
                docs_micro_batch(as_docs(docs))
                for docs in (sharing.share(micro_docs, step) if mode != "off" else micro_docs)
            )
            for step, micro_docs in enumerate(plan)
        ]
        reference_pass_s = 0.0
        if self.driver is not None:  # what train runs before step 0: the sharing decision, the reference pass
            self._sync()
            started = time.perf_counter()
            self.driver.prepare()
            self._sync()
            if spec.pairs:
                reference_pass_s = time.perf_counter() - started
        if spec.pairs:  # the activation probe feeds documents; a pair arm's memory is its peak
            activation_bytes, probe_forward_s = None, 0.0
        else:
            first_inputs = self.driver.plan(0).micro[0][0] if self.driver else self._inputs(plan[0][0])[0]
            probe_started = time.perf_counter()
            activation_bytes = device_activation_bytes(
                self.model, first_inputs, self.state.offload_manager if self.state else None
            )
            probe_forward_s = time.perf_counter() - probe_started
        if self.state is not None:
            self.state.grouping_counts.reset()  # the steps' batches only, not the probe's
        if self.peer is None and self.driver is None:  # the driver's AdamW and schedule, as train's
            from ..train.driver import optimizer_and_schedule

            settings = train_config_of(config, self.arm)  # the file's optimizer, as written
            self.optimizer, self.scheduler = optimizer_and_schedule(
                self.model.parameters(), settings, torch.device(self.device), run_steps(config)
            )
        return {
            "host_syncs_per_step": 0,
            "activation_bytes": activation_bytes,
            "probe_forward_s": probe_forward_s,
            "model_flops": model_flops,
            "reference_pass_s": reference_pass_s,
            **({"pairs": [], "reward_margin": [], "reward_accuracy": []} if spec.pairs else {}),
        }

    def _inputs(self, docs):
        """A stock arm's or a peer's micro-batch of ``docs`` (a step's rows whole), in its own layout."""
        if self.peer:
            return self.peer.collate(docs)
        return micro_batch_inputs(self.arm, docs, self.device)

    def _step_fn(self, micro, model_context=contextlib.nullcontext) -> dict[str, Any]:
        """One optimizer step on ``micro``: the driver's plan (a ``StepPlan``), or a peer's or stock arm's
        micro-batches."""
        if self.driver is not None:
            done = self.driver.run(micro, model_context)
            self.last_plan = micro
            return {**done.metrics, "lr": done.lr, "tokens": done.tokens, "pairs": done.pairs}
        if self.peer:  # TRL's trainer, with its own optimizer, scheduler and clipping
            found = self.peer(micro, model_context=model_context)
            if "accuracy" in found:
                found["reward_accuracy"] = found.pop("accuracy")
            return found
        lr = self.optimizer.param_groups[0]["lr"]
        max_grad_norm = self.config.train.optimizer.max_grad_norm
        metrics = train_step(
            self.model, micro, self.optimizer, max_grad_norm=max_grad_norm, model_context=model_context
        )
        self.scheduler.step()
        return {**metrics, "lr": lr}

    def _prepare(self, step: int):
        self.warm_pages.release()  # what the wait held goes back warm, for this step (and before its inputs)
        # collated before the clock, as every arm's: the driver's plan of the step, or the rows' batches
        return self.driver.plan(step) if self.driver else [self._inputs(docs) for docs in self.plan[step]]

    def _timed_step(self, step: int, micro) -> tuple[dict[str, Any], float]:
        start = time.perf_counter()
        if step == 0:  # a warm-up step: count the model's host syncs where the counter's cost is untimed
            syncs = HostSyncCounter()
            metrics = self._step_fn(micro, model_context=lambda counter=syncs: counter)
            self.result.host_syncs_by_op = dict(syncs.by_op)
            self.result.host_syncs_per_step = syncs.total
        else:
            metrics = self._step_fn(micro)
        self._sync()
        return metrics, time.perf_counter() - start

    def _record(self, step: int, metrics: dict[str, Any]) -> None:
        result, micro_docs = self.result, self.plan[step]
        held = self.warm_pages.hold() if self.config.ab.keep_pages_warm and self.device == "cpu" else Held()
        result.held_bytes.append(held.bytes)
        result.hold_s.append(held.seconds)
        if step == 0 and self.state is not None and self.state.compiled:
            result.compile_graphs = {"after_first_step": graph_counts()}
        count = counted_tokens if self.spec.pairs else unshared_tokens
        result.tokens.append(metrics.get("tokens", sum(count(docs) for docs in micro_docs)))
        if self.spec.pairs:
            result.pairs.append(metrics.get("pairs") or sum(len(pairs) for pairs in micro_docs))
            result.reward_margin.append(metrics["reward_margin"])
            # KTO's rows have no pair to be right about: NaN
            result.reward_accuracy.append(metrics.get("reward_accuracy", float("nan")))

    def _after_figures(self) -> None:
        """Held pages back; the compile and grouping counts; the optional profiled step (its overhead
        touches none of the figures)."""
        result, state = self.result, self.state
        self.warm_pages.release()
        if result.compile_graphs is not None:
            result.compile_graphs["after_last_step"] = graph_counts()
        if state is not None and state.packed_attention is not None:
            result.attention_grouping_counts = state.grouping_counts.to_dict()
        if self.config.ab.profile_step and not self.spec.pairs:
            last = self.plan[-1]
            micro = self.last_plan if self.driver else [self._inputs(docs) for docs in last]
            documents = self.last_plan.documents if self.driver else last
            dtype = getattr(torch, self.config.train.model.dtype)
            peak = matmul_peak(self.device, dtype, self.config.ab.threads)  # the record's, cached
            result.step_profile = profile_step(
                lambda: self._step_fn(micro),
                self.device,
                linear_flops=sum(self.profile.linear_flops(*docs_micro_batch(docs)) for docs in documents),
                peak_flops_per_s=peak["flops_per_s"],
            )


def open_arm(
    config_dict: dict,
    arm: str,
    plan: list,
    vocab_size: int,
    perturb: bool = False,
    *,
    fp32: bool = False,
    gradient_dir: str | None = None,
):
    """``arm`` set up in this process: an :class:`ArmSession`, or, for a peer that cannot run here,
    ``{"arm", "skipped": reason}``, or for a peer that runs in its own process (Unsloth) its
    finished result (it runs every step at once). ``gradient_dir``: keep the step-0 gradient there
    (``step_gradient.HeldGradient``); ``fp32``: the arm's weights cast up to fp32 (``bench/truth.py``)."""
    config = ABConfig.from_dict(config_dict)
    spec = ARM_SPECS[arm]
    if spec.peer:
        from .peers import unavailable

        if reason := unavailable(spec.peer, config, resolve_device(config.ab.device)):
            return {"arm": arm, "skipped": reason}
        if spec.peer.startswith("unsloth"):
            from .peers.unsloth_arm import run_unsloth_arm

            return run_unsloth_arm(config, arm, plan, vocab_size)
    if spec.engine == "vllm":
        from ..engines.vllm_engine import EngineError, vllm_python

        try:
            vllm_python(create=False)  # ab does not install it: train does, or make_vllm_venv.sh
        except EngineError as error:
            return {"arm": arm, "skipped": str(error)}
    session = RowsArmSession
    if spec.engine:  # online RL: sampling, then the update on shared rollouts (bench/grpo_arms.py)
        from .grpo_arms import GrpoArmSession

        session = GrpoArmSession
    try:
        return session(config, arm, plan, vocab_size, perturb, fp32=fp32, gradient_dir=gradient_dir)
    except PeerUnavailable as error:  # a peer's trainer refused to start here (trl-grpo), in its words
        return {"arm": arm, "skipped": str(error)}


def run_arm(
    config_dict: dict,
    arm: str,
    plan: list,
    vocab_size: int,
    perturb: bool = False,
    gradient_dir: str | None = None,
) -> dict:
    """Train ``config.ab.steps`` steps under ``arm`` in this process; returns an ArmResult as a dict,
    or ``{"arm", "skipped": reason}`` for a peer that cannot run here. ``perturb``: from its weights
    moved by one ulp (:func:`perturb_by_one_ulp`), the run's sensitivity (``stats.loss_parity``);
    ``gradient_dir``: keep its step-0 gradient there (``step_gradient.HeldGradient``)."""
    session = open_arm(config_dict, arm, plan, vocab_size, perturb, gradient_dir=gradient_dir)
    if isinstance(session, dict):
        return session
    for step in range(len(plan)):
        session.step(step)
    return session.finish()
