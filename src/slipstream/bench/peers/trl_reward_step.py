"""The ``trl-reward`` arm: one optimizer step as TRL's ``RewardTrainer`` takes it, on our preference pairs.

TRL's: its collator (``DataCollatorForPreference``: prompt + chosen and prompt + rejected as two right-padded
rows each pair, the chosen rows in the first half of the batch, so every prompt runs twice, with an
``attention_mask``; a ``margin`` tensor where the pairs give one); ``RewardTrainer.compute_loss`` (the
sequence classifier's forward over the padded batch, its ``logits`` split into chosen and rejected,
``-logsigmoid(r_c - r_r [- margin]).mean()`` plus ``center_rewards_coefficient * mean((r_c + r_r)^2)``;
the token count, min / mean / max reward, accuracy and margin read to the host every micro-batch into
``trainer._metrics["train"]``); ``Trainer.training_step`` (the loss divided by
``current_gradient_accumulation_steps``, ``accelerator.backward``); the Trainer's own optimizer and
scheduler (``adamw_torch``, the run's schedule) and its clipping. The model is the arm's: the same
sequence classifier, LoRA on the body and ``score`` trained in full (PEFT's ``SEQ_CLS`` task, what TRL's
docs ask for: ``modules_to_save=["score"]``). Ours: which pairs form each micro-batch and in what order.

Gradient accumulation: TRL's loss is each micro-batch's mean over its pairs, divided by the number of
micro-batches, so the gradient is the mean of the micro-batch means (with unequal micro-batches a pair in a
small one weighs more than in slipstream, where every pair of the step weighs the same). The ``loss`` this arm
reports is the mean over the step's pairs (the micro-batch means weighted by their pair counts), and so are
the margin and accuracy; with equal micro-batches they equal what TRL would log.

Left out, as from every arm: the Trainer's dataloader, callbacks and logging, and TRL's dataset preparation
(the caller's pairs come tokenized, chat template applied, answers ending with EOS; TRL tokenizes a one-row
placeholder dataset that is never iterated). ``max_length=None``: nothing is dropped (the run's reader already
refused pairs past ``data.max_seq_len``). Mixed precision off, TRL's checkpointing off, dropout disabled (TRL's
default), as in the other TRL arms.
"""

from __future__ import annotations

import torch

from .trl_base import PairMeansStep

# TRL's per-micro-batch metrics this arm returns, by the name it returns them under.
REWARD_METRICS = {"reward_margin": "margin", "accuracy": "accuracy", "mean_reward": "mean_reward"}


class TrlRewardStep(PairMeansStep):
    """Drives a real ``RewardTrainer`` one optimizer step at a time over the harness's micro-batches of pairs."""

    logged = REWARD_METRICS

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer,
        *,
        center_rewards_coefficient: float | None = None,
        device: str = "cpu",
        **run,
    ):
        """``run``: the run's steps, lr, schedule, warmup_steps, seed and grad_accum (``trl_base.trainer_run``)."""
        from datasets import Dataset
        from trl import RewardConfig, RewardTrainer

        # never iterated, but TRL prepares (tokenizes) it in any case: one plain-text row
        placeholder = Dataset.from_list([{"prompt": "a", "chosen": " b", "rejected": " c"}])
        super().__init__(
            lambda args: RewardTrainer(
                model=model, args=args, train_dataset=placeholder, processing_class=tokenizer
            ),
            RewardConfig,
            prefix="slipstream-ab-trl-reward-",
            device=device,
            **run,
            per_device_train_batch_size=1,
            max_length=None,
            center_rewards_coefficient=center_rewards_coefficient,
        )
        self.policies = [
            "TRL RewardTrainer: pairs right-padded as two rows (prompt run twice, chosen and rejected), the "
            "sequence classifier's pooled last-token score, its token count, min / mean / max reward, accuracy "
            "and margin read to the host every micro-batch, training_step, its adamw_torch optimizer and clipping",
        ]

    @classmethod
    def for_run(cls, model, tokenizer, train, *, device: str, **run):
        """The arm's trainer on the run's ``TrainConfig`` (its ``reward.center_rewards_coefficient``)."""
        center = train.reward.center_rewards_coefficient
        return cls(model, tokenizer, center_rewards_coefficient=center, device=device, **run)

    def collate(self, pairs: list[dict]) -> tuple[dict, int]:
        """TRL's padded micro-batch of ``pairs`` on the device, and the number of pairs in it."""
        examples = []
        for pair in pairs:
            example = {
                "chosen_ids": list(pair["prompt_ids"]) + list(pair["chosen_ids"]),
                "rejected_ids": list(pair["prompt_ids"]) + list(pair["rejected_ids"]),
            }
            if "margin" in pair:
                example["margin"] = pair["margin"]
            examples.append(example)
        batch = self.trainer.data_collator(examples)
        inputs = {k: (v.to(self.device) if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}
        return inputs, len(pairs)
