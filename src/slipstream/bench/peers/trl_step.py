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

from contextlib import nullcontext

import torch

from ...packing import IGNORE_INDEX
from .trl_base import TrlTrainerStep


class TrlStep(TrlTrainerStep):
    """Drives a real ``SFTTrainer`` one optimizer step at a time over the harness's micro-batches."""

    def __init__(self, model: torch.nn.Module, tokenizer, *, device: str = "cpu", **run):
        """``run``: the run's steps, lr, schedule, warmup_steps, seed and grad_accum (``trl_base.trainer_run``)."""
        from datasets import Dataset
        from trl import SFTConfig, SFTTrainer

        # The dataset is never iterated: the harness hands each micro-batch to training_step itself.
        placeholder = Dataset.from_list([{"input_ids": [0, 1], "labels": [0, 1]}])
        super().__init__(
            lambda args: SFTTrainer(
                model=model, args=args, train_dataset=placeholder, processing_class=tokenizer
            ),
            SFTConfig,
            prefix="slipstream-ab-trl-",
            device=device,
            **run,
            per_device_train_batch_size=1,
            padding_free=True,
            packing=False,
            max_length=None,
            dataset_kwargs={"skip_prepare_dataset": True},
        )
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
        lr = self.begin()
        items = torch.tensor(sum(count for _, count in micro_batches), device=self.device)
        losses = []
        for inputs, _ in micro_batches:
            with model_context():
                losses.append(self.trainer.training_step(self.model, inputs, num_items_in_batch=items))
        timed = self.end(lr)
        return {"loss": float(torch.stack(losses).sum()), **timed}
