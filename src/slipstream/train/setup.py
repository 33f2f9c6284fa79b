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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from ..atomic import write_text_atomically
from ..data import DataReport, PackingReport
from ..utilisation import FlopProfile, flop_profile, matmul_peak
from .checkpoints import Checkpoint, ResumePoint, apply_checkpoint, load_resume_point
from .config import TrainConfig
from .distributed import Distributed, setup
from .driver import StepDriver, driver_for
from .errors import TrainError
from .fingerprint import fingerprint as run_fingerprint
from .inputs import read_inputs
from .lock import RunLock
from .output_dir import CONFIG, SAMPLES, NewOutput, prepare_output, rewind_metrics
from .precision import resolve_dtype

logger = logging.getLogger("slipstream")


@dataclass
class _Run:
    """A run once set up: its driver (the step), and what the loop and the summary keep around it.

    What the driver holds (config, info, tokenizer, objective, bins, model, optimizer, scheduler,
    total, bins_for, device, dtype, evals, out, policies) is read through it: ``run.driver.model``."""

    driver: StepDriver
    packing: PackingReport
    data_report: DataReport | None
    fingerprint: dict | None  # rank 0 only
    point: ResumePoint
    lock: RunLock | None  # the output directory's, held by rank 0 until the run ends
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


def _set_up(config: TrainConfig, *, resume: bool, overwrite: bool, force: bool) -> _Run:
    """Everything before the first step, in an order the seeds depend on; every rank runs it."""
    if config.quantization.four_bit:  # said before any data is read or anything is written
        from ..extras import require

        require("bitsandbytes", "quantization.four_bit (QLoRA)")
    info = setup(config.training.distributed)
    out = Path(config.output_dir)
    new = NewOutput.of(out) if info.is_main else None  # a failed set-up leaves it as it was
    lock = RunLock.acquire(out) if info.is_main else None  # before anything there is read or changed
    try:
        return _set_up_locked(config, info, out, lock, resume=resume, overwrite=overwrite, force=force)
    except BaseException:
        if new is not None:
            new.undo(lock)  # and releases the lock
        elif lock is not None:
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
    device = info.device()
    dtype, dtype_policy = resolve_dtype(config.model.dtype, device)
    inputs = read_inputs(config, info, device, dtype)  # the tokenizer, the objective, its rows and bins
    data = inputs.data
    fingerprint = (
        run_fingerprint(config, inputs.tokenizer, world_size=info.world_size, dtype=dtype)
        if info.is_main
        else None
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
    driver = driver_for(config, info, inputs, out=out)
    driver.policies.insert(0, dtype_policy)
    run = _Run(
        driver=driver,
        packing=data.packing,
        data_report=data.report,
        fingerprint=fingerprint,
        point=point,
        lock=lock,
        flops=flop_profile(driver.base_model),
        matmul_peak=peak,
    )
    # before a checkpoint's weights are loaded: the policy as it starts (the reference pass)
    line = driver.prepare()
    if line is not None and info.is_main:
        tqdm.write(f"slipstream train: {line}")
    run.start = _restore(run, checkpoint, resume=resume)
    del checkpoint  # its tensors are in the model now
    if info.is_main:
        write_text_atomically(out / CONFIG, json.dumps(config.to_dict(), indent=1))
    info.barrier()
    return run


def _restore(run: _Run, checkpoint: Checkpoint | None, *, resume: bool) -> int:
    """Load the checkpoint resumed from and keep the metrics up to it; the step to start at."""
    driver, info, point = run.driver, run.driver.info, run.point
    if checkpoint is None:
        if resume and info.is_main:
            logger.warning("%s: no checkpoint to resume from: starting at step 0", driver.out)
        if info.is_main:
            rewind_metrics(driver.out, 0)
            rewind_metrics(driver.out, 0, SAMPLES)
        return 0
    start = apply_checkpoint(checkpoint, driver.model, driver.optimizer, driver.scheduler)
    _config_hyperparameters(driver)
    if start > driver.total:
        raise TrainError(
            f"{point.path}: the checkpoint is at step {start}, past this run's {driver.total} steps"
        )
    if info.is_main:
        kept = rewind_metrics(driver.out, start)
        if (driver.out / SAMPLES).exists():
            rewind_metrics(driver.out, start, SAMPLES)  # the answers after it are given again
        run.eval_losses = [(r["step"], r["eval_loss"]) for r in kept if "eval_loss" in r]
        if point.loss is None and kept:  # a checkpoint from before state.json held the loss
            point.loss = kept[-1]["loss"]
    logger.info("resumed from %s (step %d)", point.path, start)
    return start


def _config_hyperparameters(driver: StepDriver) -> None:
    """The config's optimizer settings over those a checkpoint restored (``--resume --force`` with a changed lr).

    ``load_state_dict`` brings back the checkpoint's lr, betas and weight decay with the moments,
    and the scheduler its base lr, so a changed ``optimizer.lr`` would silently not apply. The
    schedule itself (its shape, warmup) is this run's; the lr is recomputed for the step resumed at.
    """
    settings = driver.config.optimizer
    for group in driver.optimizer.param_groups:
        group.update(initial_lr=settings.lr, betas=tuple(settings.betas), weight_decay=settings.weight_decay)
    scheduler = driver.scheduler
    scheduler.base_lrs = [settings.lr] * len(driver.optimizer.param_groups)
    lrs = [
        lr * factor(scheduler.last_epoch)
        for lr, factor in zip(scheduler.base_lrs, scheduler.lr_lambdas, strict=True)
    ]
    for group, lr in zip(driver.optimizer.param_groups, lrs, strict=True):
        group["lr"] = lr
    scheduler._last_lr = lrs  # what get_last_lr() reports (torch keeps no public setter)
