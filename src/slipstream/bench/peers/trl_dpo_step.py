"""The ``trl-dpo`` arm: one optimizer step as TRL's ``DPOTrainer`` takes it, on our preference pairs.

TRL's: its collator (``DataCollatorForPreference``: each pair becomes two right-padded rows, prompt +
chosen in the first half of the batch and prompt + rejected in the second, so every prompt runs twice,
with a ``completion_mask`` over the answers); ``DPOTrainer.compute_loss`` (the policy forward, then a
second, no-grad reference forward of the same rows every micro-batch, each answer's log-probabilities
summed over its tokens; in 1.16 through its fused LM head, in 1.8 from the full logits; the DPO loss
of ``loss_type`` averaged over the micro-batch's pairs; the entropy, logit, token-accuracy, reward and
log-prob metrics it reads to the host every micro-batch into ``trainer._metrics["train"]``);
``Trainer.training_step`` (the loss divided by ``current_gradient_accumulation_steps``,
``accelerator.backward``); the Trainer's own optimizer and scheduler (``adamw_torch``, the run's
schedule, no weight decay) and its clipping (``accelerator.clip_grad_norm_``, 1.0). The reference is
TRL's choice for a ``PeftModel`` with ``ref_model=None``: it adds a frozen ``"ref"`` adapter, a copy
of the initial ``"default"`` one, and switches to it for the reference forward (with adapters
disabled instead only where PEFT cannot hold two ``target_parameters`` adapters); for a freshly
initialised LoRA (B = 0) both are the base model exactly. Reference log-probs are not precomputed
(``precompute_ref_log_probs=False``, TRL's default). Ours: which pairs form each micro-batch and in
what order.

Gradient accumulation: TRL's loss is each micro-batch's mean over its pairs, divided by the number of
micro-batches, so the gradient is the mean of the micro-batch means; with unequal micro-batches that
weights a pair in a small micro-batch more than one in a large one. The ``loss`` this arm reports is
the mean over all the step's pairs (the micro-batch means weighted by their pair counts), and so are
the reward metrics; with equal micro-batches they equal what TRL would log.

Left out, as from every arm: the Trainer's dataloader, callbacks and logging, and TRL's dataset
preparation (the caller's pairs come tokenized, chat template applied, answers ending with EOS; TRL
has no switch to skip its preparation for text, so it tokenizes a one-row placeholder dataset that is
never iterated). ``max_length=None``: nothing is truncated (TRL's default, 1024, would cut long pairs
from the end). Mixed precision is off (``bf16=False``): the model is already in the run's dtype; TRL's
own default would autocast. TRL's gradient checkpointing (on by default) is off: checkpointing is the
run's, as in the stock arms. Dropout is disabled, TRL's default.
"""

from __future__ import annotations

import torch

from .trl_base import PairMeansStep

# TRL's per-micro-batch metrics this arm returns, by the name it returns them under.
REWARD_METRICS = {
    "reward_margin": "rewards/margins",
    "chosen_reward": "rewards/chosen",
    "rejected_reward": "rewards/rejected",
    "accuracy": "rewards/accuracies",
}


class TrlDpoStep(PairMeansStep):
    """Drives a real ``DPOTrainer`` one optimizer step at a time over the harness's micro-batches of pairs."""

    logged = REWARD_METRICS

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer,
        *,
        beta: float = 0.1,
        loss_type: str = "sigmoid",
        device: str = "cpu",
        **run,
    ):
        """``run``: the run's steps, lr, schedule, warmup_steps, seed and grad_accum (``trl_base.trainer_run``)."""
        from datasets import Dataset
        from trl import DPOConfig, DPOTrainer

        # The dataset is never iterated, but TRL prepares (tokenizes) it in any case: one plain-text row.
        placeholder = Dataset.from_list([{"prompt": tokenizer.eos_token, "chosen": "", "rejected": ""}])
        # Both forwards run through the trainer's model: the policy's and the reference's are timed.
        super().__init__(
            lambda args: DPOTrainer(
                model=model, ref_model=None, args=args, train_dataset=placeholder, processing_class=tokenizer
            ),
            DPOConfig,
            prefix="slipstream-ab-trl-dpo-",
            device=device,
            **run,
            per_device_train_batch_size=1,
            beta=beta,
            loss_type=loss_type,
            max_length=None,
            precompute_ref_log_probs=False,
            padding_free=False,
        )
        if "ref" in getattr(self.model, "peft_config", {}):
            reference = "a frozen copy of the initial adapter"
        else:
            reference = "the base model, adapter disabled"
        self.policies = [
            "TRL DPOTrainer: pairs right-padded as two rows (prompt run twice, chosen and rejected), "
            f"a no-grad reference forward every micro-batch ({reference}), its reward and logit metrics "
            "read to the host every micro-batch, training_step, its adamw_torch optimizer and clipping",
        ]

    @classmethod
    def for_run(cls, model, tokenizer, train, *, device: str, **run):
        """The arm's trainer on the run's ``TrainConfig`` (its ``preference.beta``)."""
        return cls(model, tokenizer, beta=train.preference.beta, device=device, **run)

    def collate(self, pairs: list[dict]) -> tuple[dict, int]:
        """TRL's padded micro-batch of ``pairs`` on the device, and the number of pairs in it."""
        batch = self.trainer.data_collator(
            [{key: pair[key] for key in ("prompt_ids", "chosen_ids", "rejected_ids")} for pair in pairs]
        )
        inputs = {k: (v.to(self.device) if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}
        return inputs, len(pairs)
