"""The ``trl-kto`` arm: one optimizer step as TRL's ``KTOTrainer`` takes it, on the run's KTO rows.

TRL's: its collator (``DataCollatorForUnpairedPreference``: each row right-padded as ``prompt +
completion``, and a second padded batch of ``prompt + KL completion``, so every prompt runs twice);
``KTOTrainer.compute_loss`` (a ``no_grad`` forward of the KL sequences, the policy forward of the rows,
then, with the reference not precomputed (TRL's default), ``no_grad`` reference forwards of both every
micro-batch, log-probs summed over the completion tokens through its fused LM head; the KL baseline
``(KL_logps - ref_KL_logps).mean()`` gathered and clamped at 0; the loss of ``loss_type`` weighted by
``desirable_weight`` / ``undesirable_weight`` and ``nanmean``-ed over the micro-batch; its entropy,
logit, log-prob and reward metrics read to the host every micro-batch); ``Trainer.training_step``;
the Trainer's optimizer, schedule and clipping (``trl_base``). The reference is TRL's choice for a
``PeftModel`` with ``ref_model=None`` (a frozen copy of the initial adapter, or the adapter disabled).

Ours: which rows form each micro-batch, in what order, and each row's KL completion (the run's bins,
rotated by +1 as TRL's ``_prepare_dataset`` rotates a batch of ``per_device_train_batch_size``
sequential rows; the arm hands TRL ``KL_completion_ids`` already made, since TRL's own rotation runs
over its dataset's fixed-size batches, which are not our bins).

What TRL does differently from ``slipstream train``'s KTO, and this arm keeps as TRL does:

- its KL batch is the micro-batch (as ours), but its micro-batches are fixed row counts, ours bins
  filled by tokens; its last batch of a dataset may hold one row, whose KL completion is then its own;
- the gradient is the mean of the micro-batch means (each ``nanmean``, the Trainer dividing by the
  number of micro-batches); ours weighs every row of the step the same. This arm reports the loss as
  the micro-batch means weighted by their row counts (the step's row mean: what ours reports), the
  rewards as TRL's per-micro-batch means weighted by their desirable / undesirable rows;
- the reference runs every step (``precompute_ref_log_probs=False``, TRL's default); ours once before
  step 0; TRL truncates ``prompt + completion`` at ``max_length`` (1024) from the end (None here, as the
  run's rows are cut to ``data.max_seq_len`` already).

Left out, as from every arm: the Trainer's dataloader, callbacks and logging, and TRL's dataset
preparation (a two-row placeholder is prepared and never iterated). Mixed precision and TRL's
checkpointing off; dropout disabled (TRL's default).
"""

from __future__ import annotations

from contextlib import nullcontext

import torch

from .trl_base import TrlTrainerStep, weighted


class TrlKtoStep(TrlTrainerStep):
    """Drives a real ``KTOTrainer`` one optimizer step at a time over the harness's micro-batches of rows."""

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer,
        *,
        beta: float = 0.1,
        desirable_weight: float = 1.0,
        undesirable_weight: float = 1.0,
        loss_type: str = "kto",
        device: str = "cpu",
        **run,
    ):
        """``run``: the run's steps, lr, schedule, warmup_steps, seed and grad_accum (``trl_base.trainer_run``)."""
        from datasets import Dataset
        from trl import KTOConfig, KTOTrainer

        # Never iterated, but TRL prepares it in any case: one row of each label (its balance check).
        placeholder = Dataset.from_list(
            [
                {"prompt": "a", "completion": "b", "label": True},
                {"prompt": "a", "completion": "c", "label": False},
            ]
        )
        self.with_kl = loss_type not in ("apo_zero_unpaired",)  # TRL's own test (calculate_kl)
        super().__init__(
            lambda args: KTOTrainer(
                model=model, ref_model=None, args=args, train_dataset=placeholder, processing_class=tokenizer
            ),
            KTOConfig,
            prefix="slipstream-ab-trl-kto-",
            device=device,
            **run,
            # TRL refuses a batch of 1 where it computes the KL baseline; the harness hands it its micro-batches
            per_device_train_batch_size=2,
            beta=beta,
            desirable_weight=desirable_weight,
            undesirable_weight=undesirable_weight,
            loss_type=loss_type,
            max_length=None,
            precompute_ref_log_probs=False,
        )
        if "ref" in getattr(self.model, "peft_config", {}):
            reference = "a frozen copy of the initial adapter"
        else:
            reference = "the base model, adapter disabled"
        kl = (
            "a no_grad forward of prompt + KL completion (the prompt again)"
            if self.with_kl
            else "no KL sequence (apo_zero_unpaired)"
        )
        self.policies = [
            f"TRL KTOTrainer ({loss_type}): rows right-padded, {kl}, no-grad reference forwards every "
            f"micro-batch ({reference}), its metrics read to the host every micro-batch, training_step, its "
            "adamw_torch optimizer and clipping; as TRL differs from slipstream's kto: its KL batch is the "
            "micro-batch (here the run's bins, with their KL completions; TRL's own are per_device_train_batch_size "
            "rows in dataset order, a last batch of one row matching itself), its gradient the mean of the "
            "micro-batch means (the loss reported here: the step's row mean)",
        ]

    @classmethod
    def for_run(cls, model, tokenizer, train, *, device: str, **run):
        """The arm's trainer on the run's ``TrainConfig`` (``preference.beta`` and its ``kto:`` section)."""
        kto = train.kto
        return cls(
            model,
            tokenizer,
            beta=train.preference.beta,
            desirable_weight=kto.desirable_weight,
            undesirable_weight=kto.undesirable_weight,
            loss_type=kto.loss_type,
            device=device,
            **run,
        )

    def collate(self, rows: list[dict]) -> tuple[dict, list[bool]]:
        """TRL's padded micro-batch of ``rows`` (binned KTO rows: ``rejected_ids`` is the KL completion) on
        the device, and the rows' labels."""
        examples = []
        for row in rows:
            example = {
                "prompt_ids": row["prompt_ids"],
                "completion_ids": row["completion_ids"],
                "label": row["label"],
            }
            if self.with_kl:
                example["KL_completion_ids"] = row["rejected_ids"]
            examples.append(example)
        batch = self.trainer.data_collator(examples)
        inputs = {k: (v.to(self.device) if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}
        return inputs, [bool(row["label"]) for row in rows]

    def __call__(
        self, micro_batches: list[tuple[dict, list[bool]]], model_context=nullcontext
    ) -> dict[str, float]:
        """One optimizer step; the step's loss as the row mean, and TRL's metrics weighted by their rows."""
        means, logged, timed = self.mean_step([inputs for inputs, _ in micro_batches], model_context)
        counts = [len(labels) for _, labels in micro_batches]
        chosen = [sum(labels) for _, labels in micro_batches]
        rejected = [count - wanted for count, wanted in zip(counts, chosen, strict=True)]
        found = {
            "loss": weighted(means, counts),
            "kl": weighted(logged["kl"], counts),
            "chosen_reward": weighted(logged["rewards/chosen"], [c for c in chosen if c]),
            "rejected_reward": weighted(logged["rewards/rejected"], [r for r in rejected if r]),
        }
        found["reward_margin"] = found["chosen_reward"] - found["rejected_reward"]
        return {**found, **timed}
