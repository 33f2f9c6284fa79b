"""The one step driver: what ``slipstream train`` and every slipstream arm of ``slipstream ab`` run.

:func:`driver_for` builds a :class:`StepDriver` from one ``TrainConfig`` and its inputs
(``inputs.DriverInputs``: the tokenizer, the objective, its rows read or an A/B's planned steps): the
bins in their step order, the model loaded, checked, optimized and with its adapters, the optimizer
and schedule; :meth:`StepDriver.prepare` runs what the objective runs
before step 0; :meth:`StepDriver.step` runs optimizer step i (the objective's ``plan_step``,
``train_step``, the scheduler) and returns a :class:`StepResult`. ``train``'s loop adds
checkpoints, evaluation, metrics and samples around it (``loop.py``, its run directory in
``setup.py``); the A/B adds timing, interleaving and peers (``bench/arm_run.py``). Neither has
a step of its own, so what ``ab`` times is what ``train`` runs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from peft import LoraConfig, get_peft_model
from transformers import get_scheduler

from ..data.steps import block_order, step_order, steps_per_epoch
from ..models import build_model
from ..models.heads import PEFT_TASKS, auto_class
from ..models.qlora import load_for_qlora
from ..moe.experts import experts_modules
from ..moe.lora import add_expert_lora
from ..objectives import Objective, objective_for
from ..objectives.base import ObjectiveContext, StepPlan
from ..optimize import optimize, state_of
from ..packing.batch import cumulative
from ..refusal import Refusal, refusal_in
from .checkpoints import newest_checkpoint
from .config import ConfigError, TrainConfig
from .distributed import Distributed, unwrap, wrap
from .errors import TrainError
from .inputs import DriverInputs, read_inputs
from .precision import resolve_dtype
from .preflight import check_loaded_model, check_model_dir, weights_error
from .step import train_step


@dataclass
class StepResult:
    """What one optimizer step did: what the loop logs and the A/B times."""

    loss: float  # over every rank
    grad_norm: float
    finite: bool  # False: the update was dropped (the loss or the gradient norm was not finite)
    metrics: dict[str, Any]  # train_step's: the objective's metrics, forward_s, backward_s, ...
    tokens: int  # the step's tokens over every rank (rows whole)
    pairs: int  # preference pairs the step held (0: none)
    lr: float  # the learning rate the step ran with
    plan: StepPlan  # its micro-batches, documents and the objective's record


@dataclass
class StepDriver:
    """A model, its objective, its bins in their step order, its optimizer and schedule: step i on demand.

    It is also what the objective sees of the run (:meth:`context`): its config, ranks, bins,
    model, device and dtype (``before_training`` and ``plan_step`` read them)."""

    config: TrainConfig
    info: Distributed
    objective: Objective
    model: torch.nn.Module  # wrapped for the ranks
    optimizer: torch.optim.Optimizer
    scheduler: Any
    bins: list[list[dict]]
    bins_for: Callable[[int], Sequence[int]]  # step -> the bin indices of the whole (all-rank) step
    total: int  # the run's steps
    device: torch.device
    dtype: torch.dtype
    tokenizer: Any = None
    evals: Any = None
    out: Path | None = None  # the run's directory (``train``); None in an A/B arm
    epoch_steps: int | None = None  # optimizer steps in one epoch of the bins, where known
    policies: list[str] = field(default_factory=list)  # the model's own list: first-step decisions join it
    label_tokens: list[int] = field(init=False)  # per bin: what weighs the loss, known to every rank
    _context: ObjectiveContext | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        self.label_tokens = [self.objective.weight(b) for b in self.bins]

    @property
    def base_model(self) -> torch.nn.Module:
        """The model under the ranks' wrapper (what a reference pass or the sampler runs)."""
        return unwrap(self.model)

    def context(self) -> ObjectiveContext:
        """What the objective is handed of the run (the one place it is made). The rounds are the
        loop's: an objective that trains ``updates_per_round`` steps on one round gets round
        ``step // updates_per_round``'s bins for each of them; the resume hint is the run directory's."""
        if self._context is None:
            rounds, bins_for, out = self.objective.updates_per_round, self.bins_for, self.out

            def resume_hint() -> str:
                newest = newest_checkpoint(out) if out is not None else None
                if newest is None:
                    return "no checkpoint to resume from"
                return f"--resume continues from {newest}"

            self._context = ObjectiveContext(
                ranks=self.info,
                tokenizer=self.tokenizer,
                bins=self.bins,
                weights=self.label_tokens,
                evals=self.evals,
                device=self.device,
                dtype=self.dtype,
                model=self.model,
                base_model=self.base_model,
                steps=self.total,
                step_bins=bins_for if rounds == 1 else lambda step: list(bins_for(step // rounds)),
                epoch_steps=self.epoch_steps,
                resume_hint=resume_hint,
            )
        return self._context

    def drop_wrapper(self) -> None:
        """Hold the bare model from here on (the run's end: the ranks' wrapper must go before the group)."""
        self.model, self._context = self.base_model, None

    def prepare(self) -> str | None:
        """What the objective runs before step 0 (the reference pass, the sharing decision); its policy line."""
        line = self.objective.before_training(self.context())
        if line is not None:
            self.policies.append(line)
        return line

    def plan(self, step: int) -> StepPlan:
        """What step ``step`` trains (GRPO samples its rollouts here)."""
        context = self.context()
        return self.objective.plan_step(context, step, context.step_bins(step))

    def step(
        self, step: int, model_context: Callable[[], AbstractContextManager] = nullcontext
    ) -> StepResult:
        """Optimizer step ``step``: its plan, the one step of every objective, the schedule."""
        return self.run(self.plan(step), model_context)

    def run(
        self, plan: StepPlan, model_context: Callable[[], AbstractContextManager] = nullcontext
    ) -> StepResult:
        """One optimizer step on ``plan``; ``model_context`` wraps each forward + backward (a sync counter)."""
        lr = self.optimizer.param_groups[0]["lr"]
        metrics = train_step(
            self.model,
            plan.micro,
            self.optimizer,
            max_grad_norm=self.config.optimizer.max_grad_norm,
            model_context=model_context,
            global_tokens=plan.total,
            loss_scale=self.info.world_size,
            reduce_loss=self.info.sum_tensor,
            objective=self.objective,
        )
        self.scheduler.step()  # a skipped step keeps the plan: the lr stays a function of the step
        return StepResult(
            loss=metrics["loss"],
            grad_norm=metrics["grad_norm"],
            finite=metrics["finite"],
            metrics=metrics,
            tokens=plan.tokens,
            pairs=plan.pairs,
            lr=lr,
            plan=plan,
        )


# ----------------------------------------------------------------------------- building one
def config_advice(error: BaseException) -> str:
    """The config lines that avoid the refusal in ``error`` (its ``avoid``, read from the exception
    or its cause: `` (in the config: speedups.packed_attention: false)``), or "" where none does."""
    refusal = refusal_in(error)
    lines = refusal.config_lines() if refusal is not None else []
    return f" (in the config: {', '.join(lines)})" if lines else ""


def model_head(config: TrainConfig) -> str:
    """What the objective trains on top of the body: "causal-lm" (the LM head) or "reward" (a scalar
    ``score`` head, as ``AutoModelForSequenceClassification`` with ``num_labels=1`` places it)."""
    return objective_for(config.training.objective).model_head


def load_model(config: TrainConfig, vocab_size: int, dtype: torch.dtype):
    """The config's model with its objective's head (:func:`model_head`), in ``dtype``; a head the
    architecture has no class for is refused by name (:func:`slipstream.models.heads.auto_class`)."""
    head = model_head(config)
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
                head=head,
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
    auto, extra = auto_class(path, head, config.model.trust_remote_code)
    # a head the checkpoint lacks (a reward model's score, from a causal LM) starts from the run's seed
    torch.manual_seed(config.seed)
    try:
        return auto.from_pretrained(
            path,
            local_files_only=True,
            dtype=dtype,
            trust_remote_code=config.model.trust_remote_code,
            **extra,
        )
    except Exception as error:  # safetensors, torch and transformers each raise their own kinds
        raise weights_error(path, error) from None


def apply_lora(model, config: TrainConfig):
    """``config.lora``'s adapter, initialised from ``config.seed`` whatever the set-up consumed before:
    the same adapter in ``train`` and in every arm of an A/B (peers included)."""
    if not config.lora.enabled:
        return model
    torch.manual_seed(config.seed)
    lora = LoraConfig(
        r=config.lora.rank,
        lora_alpha=config.lora.alpha,
        lora_dropout=config.lora.dropout,
        target_modules=config.lora.target_modules,
        task_type=PEFT_TASKS[model_head(config)],
        modules_to_save=config.lora.modules_to_save or None,
    )
    model = get_peft_model(model, lora)
    if config.lora.experts:
        if not experts_modules(model):
            raise ConfigError("lora.experts is true but the model has no MoE experts")
        add_expert_lora(model, r=config.lora.rank, alpha=config.lora.alpha, dropout=config.lora.dropout)
    return model


def step_plan(
    num_bins: int, config: TrainConfig, world_size: int = 1, blocks: list[list[int]] | None = None
) -> tuple[int, Callable, int]:
    """Total steps, step -> the bin indices of the whole (all-rank) step, and the steps of an epoch
    (``data.steps``: the one order every layout and ``slipstream ab`` share; ``blocks``: each step's
    bins, fixed, for ``data.step_order: histories``)."""
    per_step = config.training.grad_accum * world_size
    if blocks is not None:
        short = next((block for block in blocks if len(block) < world_size), None)
        if short is not None:
            raise ConfigError(
                f"data.step_order histories: a step of {len(short)} bin(s) cannot give each of {world_size} "
                "ranks a micro-batch; set data.step_order shuffled, or lower data.max_seq_len"
            )
        epoch = len(blocks)
        return (
            config.training.steps or epoch * config.training.epochs,
            block_order(blocks, config.seed),
            epoch,
        )
    epoch = steps_per_epoch(num_bins, per_step)
    total = config.training.steps or epoch * config.training.epochs
    return total, step_order(num_bins, per_step, config.seed), epoch


def trainable_model(
    config: TrainConfig,
    inputs: DriverInputs,
    rows,
    evals,
    info: Distributed,
    expected_steps: int | None = None,
) -> torch.nn.Module:
    """The model loaded, checked, optimized, with its adapters and wrapped for the ranks."""
    objective, device = inputs.objective, inputs.device
    model = load_model(config, inputs.vocab_size or len(inputs.tokenizer), inputs.dtype)
    held_out = None
    if evals is not None and config.data.eval_path is not None:
        held_out = objective.documents([d for b in evals.bins for d in b])
    check_loaded_model(model, config, objective.documents(rows), held_out)
    if not config.quantization.four_bit:
        model.to(device)
    try:
        # the config's section is a Speedups; the step count decides compile "auto"
        optimize(model, config.speedups, expected_steps=expected_steps)
    except Refusal as error:  # UnsupportedArchitecture, FusedKernelsUnavailable, ...: say it in config terms
        raise TrainError(
            f"{config.model.path or config.model.preset}: {error}{config_advice(error)}"
        ) from error
    model = apply_lora(model, config)
    model.train()
    return wrap(model, info)


def optimizer_and_schedule(
    params, config: TrainConfig, device: torch.device, total: int, fused: bool = True
) -> tuple[torch.optim.Optimizer, Any]:
    """AdamW (fused where the device has it and the ranks allow) and ``optimizer.schedule`` over ``total``."""
    settings = config.optimizer
    optimizer = torch.optim.AdamW(
        [p for p in params if p.requires_grad],
        lr=settings.lr,
        betas=tuple(settings.betas),
        weight_decay=settings.weight_decay,
        **({"fused": True} if fused and device.type in ("cuda", "cpu") else {}),
    )
    scheduler = get_scheduler(
        settings.schedule, optimizer, num_warmup_steps=settings.warmup_steps, num_training_steps=total
    )
    return optimizer, scheduler


def driver_for(
    config: TrainConfig,
    info: Distributed | None = None,
    inputs: DriverInputs | None = None,
    *,
    out: Path | None = None,
) -> StepDriver:
    """The driver of ``config``, not yet prepared (:meth:`StepDriver.prepare`), on ``inputs``
    (default: ``slipstream train``'s, :func:`inputs.read_inputs`): its bins are the objective's rows
    read in ``data.steps``' order, or the steps an A/B planned (``inputs.plan``). ``out``: the run's
    directory (``train``), where the resume hint looks."""
    info = info or Distributed()
    if inputs is None:
        device = info.device()
        inputs = read_inputs(config, info, device, resolve_dtype(config.model.dtype, device)[0])
    evals = None
    if inputs.plan is not None:
        plan = inputs.plan
        bins = [rows for micro in plan for rows in micro]
        total = config.training.steps or len(plan)
        starts = cumulative(len(micro) for micro in plan)  # a step may hold fewer bins (histories)
        epoch_steps = len(plan)

        def bins_for(step: int) -> list[int]:
            return list(range(starts[step], starts[step + 1]))

        rows = [row for rows in bins for row in rows]
    else:
        data = inputs.data
        bins, rows, evals = data.bins, data.rows, data.evals
        total, bins_for, epoch_steps = step_plan(len(bins), config, info.world_size, data.blocks)
    model = trainable_model(config, inputs, rows, evals, info, total)
    optimizer, scheduler = optimizer_and_schedule(
        model.parameters(), config, inputs.device, total, fused=info.strategy != "fsdp2"
    )
    return StepDriver(
        config=config,
        info=info,
        objective=inputs.objective,
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        bins=bins,
        bins_for=bins_for,
        total=total,
        device=inputs.device,
        dtype=inputs.dtype,
        tokenizer=inputs.tokenizer,
        evals=evals,
        out=out,
        epoch_steps=epoch_steps,
        policies=state_of(unwrap(model)).policies,
    )
