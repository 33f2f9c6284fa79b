"""What every TRL arm does alike (``trl``, ``trl-dpo``, ``trl-grpo``): a real trainer on the run's
settings, its optimizer and schedule, its forward clock, and the Trainer's end of an optimizer step.

:class:`TrlTrainerStep` is their base; each arm adds its trainer's own arguments, its collation and
what it reads back (``trl_step.py``, ``trl_dpo_step.py``, ``trl_grpo_step.py``).
"""

from __future__ import annotations

import dataclasses
import shutil
import tempfile
import time
from collections.abc import Callable
from contextlib import nullcontext

import torch


class ForwardClock:
    """The time a trainer's model spends in its forwards (synced on CUDA), for a peer arm's
    forward / backward split: ``seconds`` adds up every forward since it was last zeroed."""

    def __init__(self, device: str):
        self.device, self.seconds, self._started = device, 0.0, 0.0

    def sync(self) -> None:
        if self.device == "cuda":
            torch.cuda.synchronize()

    def watch(self, model: torch.nn.Module) -> None:
        model.register_forward_pre_hook(self._start)
        model.register_forward_hook(self._end)

    def _start(self, module, args):
        self.sync()
        self._started = time.perf_counter()

    def _end(self, module, args, output):
        self.sync()
        self.seconds += time.perf_counter() - self._started


def checkpointing_argument(arguments_class) -> str:
    """The training arguments' checkpointing switch: transformers renamed it ``activation_checkpointing``
    (the old name warns a FutureWarning); 5.17 knows only ``gradient_checkpointing``."""
    fields = {f.name for f in dataclasses.fields(arguments_class)}
    return "activation_checkpointing" if "activation_checkpointing" in fields else "gradient_checkpointing"


def trainer_run(config) -> dict:
    """The run's settings every TRL arm's trainer takes (``config``: the A/B's ``ABConfig``): its steps,
    its optimizer as the file writes it (learning rate, betas, weight decay, clipping, schedule), seed and
    accumulation, as slipstream's arms train them."""
    optimizer = config.train.optimizer
    return dict(
        steps=config.train.training.steps or config.ab.steps,  # the schedule runs over the run's steps
        lr=optimizer.lr,
        betas=tuple(optimizer.betas),
        weight_decay=optimizer.weight_decay,
        max_grad_norm=optimizer.max_grad_norm,
        schedule=optimizer.schedule,
        warmup_steps=optimizer.warmup_steps,
        seed=config.train.seed,
        grad_accum=config.train.training.grad_accum,
    )


def trainer_arguments(
    arguments_class,
    output_dir: str,
    *,
    grad_accum: int = 1,
    steps: int,
    lr: float,
    betas: tuple[float, float] = (0.9, 0.999),
    weight_decay: float = 0.0,
    max_grad_norm: float = 1.0,
    schedule: str,
    warmup_steps: int,
    seed: int,
    device: str,
    **own,
):
    """The training arguments every TRL arm runs with, beside its trainer's ``own``: the run's optimizer
    (the Trainer's ``adamw_torch`` at the run's betas and weight decay, its clipping and schedule); mixed precision off (the
    model is already in the run's dtype; TRL's default would autocast); TRL's checkpointing off (the
    run's is installed like the stock arms'); nothing logged, reported or saved."""
    return arguments_class(
        output_dir=output_dir,
        gradient_accumulation_steps=grad_accum,
        max_steps=steps,
        learning_rate=lr,
        lr_scheduler_type=schedule,
        warmup_steps=warmup_steps,
        adam_beta1=betas[0],
        adam_beta2=betas[1],
        weight_decay=weight_decay,
        max_grad_norm=max_grad_norm,
        optim="adamw_torch",
        bf16=False,
        fp16=False,
        **{checkpointing_argument(arguments_class): False},
        use_cpu=device == "cpu",
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
        seed=seed,
        **own,
    )


def optimizer_step(trainer, model, parameters) -> float:
    """The Trainer's end of an optimizer step: clip (its ``max_grad_norm``), step the optimizer and the
    schedule, zero the gradients; the gradient norm before clipping."""
    # max_grad_norm 0: no clipping (as the Trainer's own loop skips it), the norm still measured
    grad_norm = trainer.accelerator.clip_grad_norm_(parameters, trainer.args.max_grad_norm or float("inf"))
    trainer.optimizer.step()
    trainer.lr_scheduler.step()
    model.zero_grad()
    return float(grad_norm)


class TrlTrainerStep:
    """A TRL trainer driven one optimizer step at a time by the harness (never by its own loop).

    ``make_trainer(args)`` builds the trainer on :func:`trainer_arguments` (the run's ``steps``,
    ``device`` and the rest of ``arguments``); its optimizer and schedule are made here, its model's
    forwards timed by a :class:`ForwardClock`. A step runs :meth:`begin`, the arm's micro-batches
    through ``trainer.training_step``, then :meth:`end` (clip, optimizer, schedule)."""

    policies: list[str]

    def __init__(
        self, make_trainer: Callable, arguments_class, *, prefix: str, steps: int, device: str, **arguments
    ):
        self.device = device
        self._output_dir = tempfile.mkdtemp(prefix=prefix)
        args = trainer_arguments(arguments_class, self._output_dir, steps=steps, device=device, **arguments)
        self.trainer = make_trainer(args)
        self.model = self.trainer.model
        self.trainer.create_optimizer_and_scheduler(num_training_steps=steps)
        # Only the active adapter: TRL's frozen "ref" copy, where it made one, is not trained.
        self.parameters = [p for p in self.model.parameters() if p.requires_grad]
        self.clock = ForwardClock(device)
        self.clock.watch(self.model)
        self._started = 0.0

    def begin(self) -> float:
        """Start a step's clock; the learning rate this step's update runs with."""
        self._started = time.perf_counter()
        self.clock.seconds = 0.0
        return self.trainer.lr_scheduler.get_last_lr()[0]

    def end(self, lr: float) -> dict[str, float]:
        """The Trainer's end of the step (clip, optimizer, schedule, zero); its grad norm, lr and times."""
        grad_norm = optimizer_step(self.trainer, self.model, self.parameters)
        self.clock.sync()
        total = time.perf_counter() - self._started
        return {
            "grad_norm": grad_norm,
            "lr": lr,
            "forward_s": self.clock.seconds,
            # backward, TRL's metric reads, clipping and the optimizer step
            "backward_s": total - self.clock.seconds,
        }

    def mean_step(
        self, inputs: list[dict], model_context
    ) -> tuple[list[float], dict[str, list], dict[str, float]]:
        """One optimizer step of a trainer whose loss is each micro-batch's mean (DPO, reward, KTO): every
        micro-batch's mean loss (the Trainer's division by the micro-batch count undone), the metrics TRL
        logged, one value a micro-batch, and the step's grad norm, lr and times; TRL's metrics cleared after,
        as ``Trainer.log`` clears them every logging step."""
        trainer = self.trainer
        lr = self.begin()
        # the Trainer's loop sets it to the number of micro-batches in the update; training_step divides by it
        trainer.current_gradient_accumulation_steps = len(inputs)
        metrics = trainer._metrics["train"]
        metrics.clear()
        losses = []
        for micro in inputs:
            with model_context():
                losses.append(trainer.training_step(self.model, micro))
        timed = self.end(lr)
        logged = {key: list(values) for key, values in metrics.items()}
        metrics.clear()
        return [float(loss) * len(inputs) for loss in losses], logged, timed

    def close(self) -> None:
        shutil.rmtree(self._output_dir, ignore_errors=True)


class PairMeansStep(TrlTrainerStep):
    """A pair trainer whose micro-batches are ``(inputs, pairs)`` (DPO, reward): the step's loss and the
    ``logged`` metrics TRL keeps (``{name: TRL's key}``), each the mean over the step's pairs."""

    logged: dict[str, str] = {}

    def __call__(self, micro_batches: list[tuple[dict, int]], model_context=nullcontext) -> dict[str, float]:
        means, logged, timed = self.mean_step([inputs for inputs, _ in micro_batches], model_context)
        counts = [count for _, count in micro_batches]
        found = {name: weighted(logged[key], counts) for name, key in self.logged.items()}
        return {"loss": weighted(means, counts), **timed, **found}


def weighted(means: list[float], counts: list[int]) -> float:
    """Per-micro-batch means over all their items (pairs, rows): each mean weighted by its count; NaN
    where there are none (TRL logs a mean only where a micro-batch holds such items)."""
    total = sum(counts)
    if not total:
        return float("nan")
    return sum(mean * count for mean, count in zip(means, counts, strict=True)) / total
