"""The ``trl`` arm: one optimizer step as TRL's ``SFTTrainer`` takes it, on our bins.

TRL's: the padding-free collator (``DataCollatorForLanguageModeling(padding_free=True)``: one
row, restarting ``position_ids``, each document's first label masked) over each micro-batch's
documents; ``SFTTrainer.compute_loss`` (its fused LM head, the per-token negative
log-likelihood summed over ``num_items_in_batch``, and the entropy and token-accuracy metrics
it reads to the host every micro-batch); ``Trainer.training_step`` (``accelerator.backward``);
the Trainer's own optimizer and scheduler (``adamw_torch``, the run's schedule, no weight decay) and
its clipping (``accelerator.clip_grad_norm_``, 1.0); ``num_items_in_batch`` counted as the
Trainer counts it (labels after the shift). Ours: which documents form each micro-batch and
in what order, so TRL's loss curve must match ours step for step.

Left out, as from every arm: the Trainer's dataloader, callbacks and logging. Mixed precision
is off (``bf16=False``): the model is already in the run's dtype, as in every arm; TRL's own
default would autocast on a bf16-capable device. Checkpointing is the stock arms' (the run's).
"""

from __future__ import annotations

import dataclasses
import shutil
import tempfile
import time
from contextlib import nullcontext

import torch

IGNORE_INDEX = -100


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


def trainer_arguments(
    arguments_class,
    output_dir: str,
    *,
    grad_accum: int,
    steps: int,
    lr: float,
    schedule: str,
    warmup_steps: int,
    seed: int,
    device: str,
    **own,
):
    """The training arguments every TRL arm runs with, beside its trainer's ``own``: the run's schedule
    with the Trainer's ``adamw_torch`` (no weight decay) and clipping at 1.0; mixed precision off (the
    model is already in the run's dtype; TRL's default would autocast); TRL's checkpointing off (the
    run's is installed like the stock arms'); nothing logged, reported or saved."""
    return arguments_class(
        output_dir=output_dir,
        gradient_accumulation_steps=grad_accum,
        max_steps=steps,
        learning_rate=lr,
        lr_scheduler_type=schedule,
        warmup_steps=warmup_steps,
        weight_decay=0.0,
        max_grad_norm=1.0,
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
    grad_norm = trainer.accelerator.clip_grad_norm_(parameters, trainer.args.max_grad_norm)
    trainer.optimizer.step()
    trainer.lr_scheduler.step()
    model.zero_grad()
    return float(grad_norm)


class TrlStep:
    """Drives a real ``SFTTrainer`` one optimizer step at a time over the harness's micro-batches."""

    def __init__(self, model: torch.nn.Module, config, tokenizer, device: str):
        from datasets import Dataset
        from trl import SFTConfig, SFTTrainer

        self.device = device
        self._output_dir = tempfile.mkdtemp(prefix="slipstream-ab-trl-")
        args = trainer_arguments(
            SFTConfig,
            self._output_dir,
            grad_accum=config.grad_accum,
            steps=config.steps,
            lr=config.lr,
            schedule=config.schedule,
            warmup_steps=config.lr_warmup_steps,
            seed=config.seed,
            device=device,
            per_device_train_batch_size=1,
            padding_free=True,
            packing=False,
            max_length=None,
            dataset_kwargs={"skip_prepare_dataset": True},
        )
        # The dataset is never iterated: the harness hands each micro-batch to training_step itself.
        placeholder = Dataset.from_list([{"input_ids": [0, 1], "labels": [0, 1]}])
        self.trainer = SFTTrainer(
            model=model, args=args, train_dataset=placeholder, processing_class=tokenizer
        )
        self.model = self.trainer.model
        self.trainer.create_optimizer_and_scheduler(num_training_steps=config.steps)
        self.parameters = [p for p in self.model.parameters() if p.requires_grad]
        self.clock = ForwardClock(device)
        self.clock.watch(self.model)
        self.policies = [
            "TRL SFTTrainer: padding-free collator, compute_loss (fused LM head, entropy and token "
            "accuracy read every micro-batch), training_step, its adamw_torch optimizer and clipping",
        ]

    def collate(self, docs: list[dict]) -> tuple[dict, int]:
        """TRL's padding-free row of ``docs`` on the device, and its label tokens counted as the Trainer counts."""
        batch = self.trainer.data_collator(
            [{"input_ids": d["input_ids"], "labels": d["labels"]} for d in docs]
        )
        count = int(batch["labels"][..., 1:].ne(IGNORE_INDEX).sum())
        inputs = {k: (v.to(self.device) if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}
        return inputs, count

    def __call__(self, micro_batches: list[tuple[dict, int]], model_context=nullcontext) -> dict[str, float]:
        """One optimizer step over ``micro_batches``; the metrics ``train_step`` returns."""
        start = time.perf_counter()
        self.clock.seconds = 0.0
        lr = self.trainer.lr_scheduler.get_last_lr()[0]  # what this step's update runs with
        items = torch.tensor(sum(count for _, count in micro_batches), device=self.device)
        losses = []
        for inputs, _ in micro_batches:
            with model_context():
                losses.append(self.trainer.training_step(self.model, inputs, num_items_in_batch=items))
        grad_norm = optimizer_step(self.trainer, self.model, self.parameters)
        loss = float(torch.stack(losses).sum())
        self.clock.sync()
        total = time.perf_counter() - start
        return {
            "loss": loss,
            "grad_norm": grad_norm,
            "lr": lr,
            "forward_s": self.clock.seconds,
            # backward, TRL's metric reads, clipping and the optimizer step
            "backward_s": total - self.clock.seconds,
        }

    def close(self) -> None:
        shutil.rmtree(self._output_dir, ignore_errors=True)
