"""``slipstream train``'s set-up: everything before the first step, in an order the seeds depend on.

The tokenizer, the objective's rows and bins (``objective.read``), the model (loaded, checked,
optimized, its adapters, wrapped for the ranks), the optimizer and schedule, the step plan, what
the objective runs before step 0 (``objective.before_training``: the reference pass), and the
checkpoint resumed from. The loop itself is ``loop.py``; its metrics and summary ``metrics.py``.
"""

from __future__ import annotations

import json
import logging
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from peft import LoraConfig, get_peft_model
from tqdm import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer, get_scheduler

from ..atomic import write_text_atomically
from ..data import DataReport, PackingReport, demo_tokenizer
from ..data.steps import step_order, steps_per_epoch
from ..models import build_model
from ..models.qlora import load_for_qlora
from ..moe.experts import experts_modules
from ..moe.lora import add_expert_lora
from ..objectives import Objective, objective_for
from ..objectives.base import ObjectiveContext
from ..optimize import optimize, state_of
from ..refusal import Refusal, refusal_in
from ..utilisation import FlopProfile, flop_profile, matmul_peak
from .checkpoints import Checkpoint, ResumePoint, apply_checkpoint, load_resume_point, newest_checkpoint
from .config import ConfigError, TrainConfig
from .distributed import Distributed, setup, unwrap, wrap
from .errors import TrainError
from .fingerprint import fingerprint as run_fingerprint
from .lock import RunLock
from .output_dir import CONFIG, SAMPLES, prepare_output, rewind_metrics
from .precision import resolve_dtype
from .preflight import check_lora_targets, check_model_dir, check_token_ids, weights_error, with_chat_template

logger = logging.getLogger("slipstream")


def load_tokenizer(config: TrainConfig):
    if config.model.preset is not None:
        return with_chat_template(demo_tokenizer(), config)
    check_model_dir(
        config.model.path
    )  # before anything reads it: a missing directory is not a network problem
    try:
        tokenizer = AutoTokenizer.from_pretrained(
            config.model.path, local_files_only=True, trust_remote_code=config.model.trust_remote_code
        )
    except (OSError, ValueError) as error:
        raise TrainError(
            f"{config.model.path}: no usable tokenizer saved beside the model ({error})"
        ) from None
    return with_chat_template(tokenizer, config)  # data.chat_template: another template than the model's


def config_advice(error: BaseException) -> str:
    """The config lines that avoid the refusal in ``error`` (its ``avoid``, read from the exception
    or its cause: `` (in the config: speedups.packed_attention: false)``), or "" where none does."""
    refusal = refusal_in(error)
    lines = refusal.config_lines() if refusal is not None else []
    return f" (in the config: {', '.join(lines)})" if lines else ""


def load_model(config: TrainConfig, vocab_size: int, dtype: torch.dtype):
    if config.model.preset is not None:
        if config.quantization.four_bit:
            raise ConfigError(
                "quantization.four_bit loads a model directory: set model.path, not model.preset"
            )
        try:
            return build_model(
                config.model.preset,
                vocab_size=vocab_size,
                layers=config.model.layers,
                seed=config.seed,
                dtype=dtype,
            )
        except KeyError as error:
            raise ConfigError(f"model.preset: {error.args[0]}") from None
    path = check_model_dir(config.model.path)
    if config.quantization.four_bit:
        return load_for_qlora(
            path,
            double_quant=config.quantization.double_quant,
            compute_dtype=dtype,
            trust_remote_code=config.model.trust_remote_code,
        )
    try:
        return AutoModelForCausalLM.from_pretrained(
            path, local_files_only=True, dtype=dtype, trust_remote_code=config.model.trust_remote_code
        )
    except Exception as error:  # safetensors, torch and transformers each raise their own kinds
        raise weights_error(path, error) from None


def apply_lora(model, config: TrainConfig):
    if not config.lora.enabled:
        return model
    lora = LoraConfig(
        r=config.lora.rank,
        lora_alpha=config.lora.alpha,
        lora_dropout=config.lora.dropout,
        target_modules=config.lora.target_modules,
        task_type="CAUSAL_LM",
        modules_to_save=config.lora.modules_to_save or None,
    )
    model = get_peft_model(model, lora)
    if config.lora.experts:
        if not experts_modules(model):
            raise ConfigError("lora.experts is true but the model has no MoE experts")
        add_expert_lora(model, r=config.lora.rank, alpha=config.lora.alpha, dropout=config.lora.dropout)
    return model


def _step_plan(num_bins: int, config: TrainConfig, world_size: int = 1) -> tuple[int, Callable]:
    """Total steps, and step -> the bin indices of the whole (all-rank) step (``data.steps``: the
    one order every layout and ``slipstream ab`` share)."""
    per_step = config.training.grad_accum * world_size
    total = config.training.steps or steps_per_epoch(num_bins, per_step) * config.training.epochs
    return total, step_order(num_bins, per_step, config.seed)


@dataclass
class _Run:
    """A run once set up: what the step loop trains, and what the summary reports."""

    config: TrainConfig
    info: Distributed
    out: Path
    tokenizer: Any
    objective: Objective  # what the run trains for (slipstream.objectives): the loop never asks its name
    bins: list[list[dict]]
    label_tokens: list[int]  # per bin: what weights the loss (label tokens, pairs), known to every rank
    packing: PackingReport
    data_report: DataReport | None
    dtype: torch.dtype
    device: torch.device
    fingerprint: dict | None  # rank 0 only
    point: ResumePoint
    model: torch.nn.Module
    policies: list[str]
    optimizer: torch.optim.Optimizer
    scheduler: Any
    total: int
    bins_for: Callable[[int], list[int]]
    lock: RunLock | None  # the output directory's, held by rank 0 until the run ends
    evals: Any = None  # data.eval_path / data.eval_fraction: the objective's eval set
    start: int = 0  # the step resumed from
    # (step, eval loss or None where not finite), the resumed run's earlier ones too
    eval_losses: list[tuple[int, float | None]] = field(default_factory=list)
    flops: FlopProfile | None = None  # the model's FLOPs per token, head row and attention pair
    matmul_peak: dict | None = None  # the device's measured peak (rank 0), utilisation.matmul_peak
    # this invocation's steps: (model FLOPs of the whole step, every rank's bins; seconds; tokens)
    step_work: list[tuple[int, float, int]] = field(default_factory=list)
    # an objective that evaluates more than a loss: (step, its eval metrics)
    eval_metrics: list[tuple[int, dict]] = field(default_factory=list)
    last_metrics: dict | None = None  # the last step's metrics (loss first)
    last_plan: Any = None  # the last step's objectives.StepPlan (its documents, its record)
    context: ObjectiveContext | None = None  # what the objective reads of the run (objective_context)

    @property
    def base_model(self) -> torch.nn.Module:
        """The model under the ranks' wrapper (what a reference pass runs)."""
        return unwrap(self.model)


def objective_context(run: _Run) -> ObjectiveContext:
    """What the objective may read of ``run`` (``before_training``, ``plan_step``). The rounds are the
    loop's: an objective that trains ``updates_per_round`` steps on one round gets round
    ``step // updates_per_round``'s bins for each of them; the resume hint is the output directory's."""
    rounds = run.objective.updates_per_round

    def resume_hint() -> str:
        newest = newest_checkpoint(run.out)
        return f"--resume continues from {newest}" if newest is not None else "no checkpoint to resume from"

    return ObjectiveContext(
        ranks=run.info,
        tokenizer=run.tokenizer,
        bins=run.bins,
        weights=run.label_tokens,
        evals=run.evals,
        device=run.device,
        dtype=run.dtype,
        model=run.model,
        base_model=run.base_model,
        steps=run.total,
        step_bins=run.bins_for if rounds == 1 else lambda step: run.bins_for(step // rounds),
        resume_hint=resume_hint,
    )


def objective_of(config: TrainConfig) -> Objective:
    """The objective ``training.objective`` names (the config checked it is registered)."""
    return objective_for(config.training.objective)(config)


def _data(config: TrainConfig, tokenizer, info: Distributed, objective: Objective | None = None):
    """The objective's rows and bins, the packing and data reports, and the eval set."""
    found = (objective or objective_of(config)).read(tokenizer, info)
    return found.rows, found.bins, found.packing, found.report, found.evals


def _trainable_model(
    config: TrainConfig,
    tokenizer,
    samples,
    device,
    dtype,
    dtype_policy: str,
    info,
    evals,
    objective: Objective,
    expected_steps: int | None = None,
):
    """The model loaded, checked, optimized, with its adapters and wrapped for the ranks; and its policies."""
    model = load_model(config, len(tokenizer), dtype)
    check_lora_targets(model, config)
    check_token_ids(objective.documents(samples), model, config.data.path or "the demo data")
    if evals is not None and config.data.eval_path is not None:
        held_out = [d for b in evals.bins for d in b]
        check_token_ids(objective.documents(held_out), model, config.data.eval_path)
    if not config.quantization.four_bit:
        model.to(device)
    try:
        # the config's section is a Speedups; the step count decides compile "auto"
        optimize(model, config.speedups, expected_steps=expected_steps)
    except Refusal as error:  # UnsupportedArchitecture, FusedKernelsUnavailable, ...: say it in config terms
        raise TrainError(
            f"{config.model.path or config.model.preset}: {error}{config_advice(error)}"
        ) from error
    torch.manual_seed(config.seed)  # adapters start the same whatever the set-up consumed
    model = apply_lora(model, config)
    model.train()
    # The model's own list: decisions made on the first step (loss chunk size) join it there.
    policies = state_of(model).policies
    policies.insert(0, dtype_policy)
    return wrap(model, info), policies


def _optimizer(config: TrainConfig, model, device: torch.device, info: Distributed):
    params = [p for p in model.parameters() if p.requires_grad]
    fused = {"fused": True} if device.type in ("cuda", "cpu") and info.strategy != "fsdp2" else {}
    return torch.optim.AdamW(
        params,
        lr=config.optimizer.lr,
        betas=tuple(config.optimizer.betas),
        weight_decay=config.optimizer.weight_decay,
        **fused,
    )


def _set_up(config: TrainConfig, *, resume: bool, overwrite: bool, force: bool) -> _Run:
    """Everything before the first step, in an order the seeds depend on; every rank runs it."""
    if config.quantization.four_bit:  # said before any data is read or anything is written
        from ..extras import require

        require("bitsandbytes", "quantization.four_bit (QLoRA)")
    info = setup(config.training.distributed)
    out = Path(config.output_dir)
    lock = RunLock.acquire(out) if info.is_main else None  # before anything there is read or changed
    try:
        return _set_up_locked(config, info, out, lock, resume=resume, overwrite=overwrite, force=force)
    except BaseException:
        if lock is not None:
            lock.release()
        raise


def _set_up_locked(
    config: TrainConfig,
    info: Distributed,
    out: Path,
    lock: RunLock | None,
    *,
    resume: bool,
    overwrite: bool,
    force: bool,
) -> _Run:
    resumable = prepare_output(out, resume=resume, overwrite=overwrite) if info.is_main else False
    info.barrier()
    random.seed(config.seed)
    torch.manual_seed(config.seed)
    tokenizer = load_tokenizer(config)
    objective = objective_of(config)
    samples, bins, packing, data_report, evals = _data(config, tokenizer, info, objective)
    device = info.device()
    dtype, dtype_policy = resolve_dtype(config.model.dtype, device)
    fingerprint = (
        run_fingerprint(config, tokenizer, world_size=info.world_size, dtype=dtype) if info.is_main else None
    )
    point, checkpoint = load_resume_point(
        out,
        fingerprint,
        info,
        resumable=resume and resumable,
        force=force,
        skips_nonfinite=config.training.on_nonfinite == "skip",
    )
    if info.is_main:
        tqdm.write(f"slipstream train: {dtype_policy}")
    # measured once per device, dtype, threads and torch (cached), before the model takes the memory
    peak = matmul_peak(device, dtype) if info.is_main else None
    total, bins_for = _step_plan(len(bins), config, info.world_size)
    model, policies = _trainable_model(
        config, tokenizer, samples, device, dtype, dtype_policy, info, evals, objective, expected_steps=total
    )
    optimizer = _optimizer(config, model, device, info)
    scheduler = get_scheduler(
        config.optimizer.schedule,
        optimizer,
        num_warmup_steps=config.optimizer.warmup_steps,
        num_training_steps=total,
    )
    run = _Run(
        config=config,
        info=info,
        out=out,
        tokenizer=tokenizer,
        objective=objective,
        bins=bins,
        label_tokens=[objective.weight(b) for b in bins],
        packing=packing,
        data_report=data_report,
        dtype=dtype,
        device=device,
        fingerprint=fingerprint,
        point=point,
        model=model,
        policies=policies,
        optimizer=optimizer,
        scheduler=scheduler,
        total=total,
        bins_for=bins_for,
        lock=lock,
        evals=evals,
        flops=flop_profile(unwrap(model)),
        matmul_peak=peak,
    )
    # before a checkpoint's weights are loaded: the policy as it starts (the reference pass)
    run.context = objective_context(run)
    line = objective.before_training(run.context)
    if line is not None:
        run.policies.append(line)
        if info.is_main:
            tqdm.write(f"slipstream train: {line}")
    run.start = _restore(run, checkpoint, resume=resume)
    del checkpoint  # its tensors are in the model now
    if info.is_main:
        write_text_atomically(out / CONFIG, json.dumps(config.to_dict(), indent=1))
    info.barrier()
    return run


def _restore(run: _Run, checkpoint: Checkpoint | None, *, resume: bool) -> int:
    """Load the checkpoint resumed from and keep the metrics up to it; the step to start at."""
    info, point = run.info, run.point
    if checkpoint is None:
        if resume and info.is_main:
            logger.warning("%s: no checkpoint to resume from: starting at step 0", run.out)
        if info.is_main:
            rewind_metrics(run.out, 0)
            rewind_metrics(run.out, 0, SAMPLES)
        return 0
    start = apply_checkpoint(checkpoint, run.model, run.optimizer, run.scheduler)
    _config_hyperparameters(run)
    if start > run.total:
        raise TrainError(
            f"{point.path}: the checkpoint is at step {start}, past this run's {run.total} steps"
        )
    if info.is_main:
        kept = rewind_metrics(run.out, start)
        if (run.out / SAMPLES).exists():
            rewind_metrics(run.out, start, SAMPLES)  # the answers after it are given again
        run.eval_losses = [(r["step"], r["eval_loss"]) for r in kept if "eval_loss" in r]
        if point.loss is None and kept:  # a checkpoint from before state.json held the loss
            point.loss = kept[-1]["loss"]
    logger.info("resumed from %s (step %d)", point.path, start)
    return start


def _config_hyperparameters(run: _Run) -> None:
    """The config's optimizer settings over those a checkpoint restored (``--resume --force`` with a changed lr).

    ``load_state_dict`` brings back the checkpoint's lr, betas and weight decay with the moments,
    and the scheduler its base lr, so a changed ``optimizer.lr`` would silently not apply. The
    schedule itself (its shape, warmup) is this run's; the lr is recomputed for the step resumed at.
    """
    settings = run.config.optimizer
    for group in run.optimizer.param_groups:
        group.update(initial_lr=settings.lr, betas=tuple(settings.betas), weight_decay=settings.weight_decay)
    scheduler = run.scheduler
    scheduler.base_lrs = [settings.lr] * len(run.optimizer.param_groups)
    lrs = [
        lr * factor(scheduler.last_epoch)
        for lr, factor in zip(scheduler.base_lrs, scheduler.lr_lambdas, strict=True)
    ]
    for group, lr in zip(run.optimizer.param_groups, lrs, strict=True):
        group["lr"] = lr
    scheduler._last_lr = lrs  # what get_last_lr() reports (torch keeps no public setter)
