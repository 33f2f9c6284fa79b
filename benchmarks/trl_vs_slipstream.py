"""TRL's own packed SFT vs slipstream: tokens/s of LoRA training, same model, data, LoRA config and seed.

Arms (one process, one after the other, the same torch threads):

- trl: ``SFTTrainer`` with its own packing (``packing=True``, ``packing_strategy="bfd"``,
  ``padding_free=True``), stock SDPA attention (transformers builds the block-diagonal mask
  from position_ids), LoRA on q/k/v/o. Its step is TRL's as shipped, including the fused LM
  head and the entropy / token-accuracy metrics it logs every step.
- slipstream: ``slipstream.optimize`` (packed attention) + ``train_step`` (token-weighted)
  over ``pack_samples``' best-fit-decreasing bins, the same LoRA config.

Both: ``qwen3-bench-cpu`` (hidden 256, 4 layers, GQA 4/2, head_dim 128, Qwen3's real
vocabulary of 151,936; the demo tokenizer's ids are valid ids of it), the built-in demo chats
(full-sequence labels), bins of ``--max-seq-len`` tokens, one bin per optimizer step, AdamW at a constant LR, no weight decay,
grad clipping 1.0, fp32, no activation checkpointing (TRL's default turns it on: off here so
both arms do the same work). Tokens/s counts real tokens only, over the timed steps after the
warm-up, from the end of one optimizer step to the end of the last (data, forward, backward,
clipping, optimizer, logging all inside).

The two arms pack differently, so their loss curves are not step-aligned. To check that they
compute the same thing, a third run ("parity") trains slipstream's loop on exactly the rows
TRL trained on, in TRL's order (split back into documents by PackedCollator): its curve must
match TRL's step for step, and its tokens/s is the like-for-like figure on identical rows.

    python benchmarks/trl_vs_slipstream.py [--steps 10] [--warmup 2] [--max-seq-len 2048]

Target (2-core CPU): slipstream >= 1.5x TRL.
"""

from __future__ import annotations

import argparse
import shlex
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field

import torch

from slipstream.models import preset_vocab_size

TARGET = 1.5
LORA = dict(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
PARITY_TOLERANCE = 1e-3


@dataclass
class ArmResult:
    name: str
    losses: list[float] = field(default_factory=list)  # one per optimizer step, warm-up included
    timed_tokens: int = 0
    timed_seconds: float = 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.timed_tokens / self.timed_seconds


def lora_model(name: str, vocab_size: int, seed: int, packed_attention: bool):
    """The same random base weights and the same LoRA initialisation in every arm."""
    from peft import LoraConfig, get_peft_model

    import slipstream
    from slipstream.models import build_model

    model = build_model(name, vocab_size=vocab_size, seed=seed, attn_implementation="sdpa")
    if packed_attention:
        slipstream.optimize(model, packed_attention=True)
    torch.manual_seed(seed)
    return get_peft_model(model, LoraConfig(task_type="CAUSAL_LM", **LORA))


def run_trl(args, tokenizer, samples) -> tuple[ArmResult, list[dict]]:
    """TRL's SFTTrainer with its own BFD packing; returns its result and the rows it trained on."""
    from datasets import Dataset
    from transformers import PrinterCallback, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    result = ArmResult("trl")
    step_tokens: dict[int, int] = {}
    rows_trained: list[dict] = []
    step_end_times: list[float] = []

    class RecordingSFTTrainer(SFTTrainer):
        """Counts each micro-batch's tokens and keeps the rows; the training itself is TRL's."""

        def training_step(self, model, inputs, num_items_in_batch=None):
            step = self.state.global_step
            step_tokens[step] = step_tokens.get(step, 0) + int(inputs["position_ids"].numel())
            lengths = torch.diff(inputs["cu_seq_lens_q"]).tolist()
            rows_trained.append(
                {
                    "input_ids": inputs["input_ids"][0].tolist(),
                    "labels": inputs["labels"][0].tolist(),
                    "seq_lengths": lengths,
                }
            )
            return super().training_step(model, inputs, num_items_in_batch)

    class Clock(TrainerCallback):
        def on_step_end(self, args_, state, control, **kwargs):
            step_end_times.append(time.perf_counter())

        def on_log(self, args_, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                result.losses.append(float(logs["loss"]))

    model = lora_model(
        args.model, preset_vocab_size(args.model) or len(tokenizer), args.seed, packed_attention=False
    )
    config = SFTConfig(
        output_dir=tempfile.mkdtemp(prefix="trl-vs-slipstream-"),
        max_steps=args.warmup + args.steps,
        max_length=args.max_seq_len,
        packing=True,
        packing_strategy="bfd",
        padding_free=True,
        per_device_train_batch_size=1,
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        optim="adamw_torch",
        bf16=False,
        activation_checkpointing=False,
        use_cpu=True,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        seed=args.seed,
    )
    trainer = RecordingSFTTrainer(
        model=model,
        args=config,
        train_dataset=Dataset.from_list(samples),  # tokenized: TRL skips tokenizing and packs it
        processing_class=tokenizer,
        callbacks=[Clock()],
    )
    trainer.remove_callback(PrinterCallback)  # the loss curves are printed at the end
    try:
        trainer.train()
    finally:
        shutil.rmtree(config.output_dir, ignore_errors=True)
    result.timed_seconds = step_end_times[-1] - step_end_times[args.warmup - 1]
    result.timed_tokens = sum(step_tokens[s] for s in range(args.warmup, args.warmup + args.steps))
    return result, rows_trained


def run_slipstream(args, tokenizer, micro_batches: list[list[dict]], name: str) -> ArmResult:
    """slipstream's own loop: one packed row per step, token-weighted, the same optimizer settings."""
    from slipstream import PackedCollator
    from slipstream.train.step import train_step

    result = ArmResult(name)
    model = lora_model(
        args.model, preset_vocab_size(args.model) or len(tokenizer), args.seed, packed_attention=True
    ).train()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    collate = PackedCollator()
    start = None
    for step, features in enumerate(micro_batches):
        if step == args.warmup:
            start = time.perf_counter()
        inputs = collate(features)
        out = train_step(model, [(inputs, inputs.batch.num_label_tokens)], optimizer, max_grad_norm=1.0)
        result.losses.append(out["loss"])
        if step >= args.warmup:
            result.timed_tokens += inputs.batch.num_tokens
    result.timed_seconds = time.perf_counter() - start
    return result


def curve(losses: list[float]) -> str:
    return " ".join(f"{loss:.4f}" for loss in losses)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="qwen3-bench-cpu")
    parser.add_argument("--max-seq-len", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=10, help="timed optimizer steps")
    parser.add_argument("--warmup", type=int, default=2, help="untimed optimizer steps first")
    parser.add_argument("--rows", type=int, default=300, help="built-in demo chat rows")
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-parity", action="store_true", help="skip the parity run")
    args = parser.parse_args()
    if args.warmup < 1:
        parser.error("--warmup must be at least 1 (the clock starts at the end of a step)")

    from slipstream.bench.fingerprint import describe, fingerprint
    from slipstream.data import demo_samples, demo_tokenizer, pack_samples

    print("command: python " + " ".join(shlex.quote(a) for a in sys.argv))
    print("machine: " + describe(fingerprint()))
    tokenizer = demo_tokenizer()
    samples = demo_samples(tokenizer, num_rows=args.rows, seed=args.seed)
    bins, report = pack_samples(samples, args.max_seq_len, seed=args.seed)
    total = args.warmup + args.steps
    if len(bins) < total:
        parser.error(f"{len(bins)} bins for {total} steps: raise --rows")
    print(f"slipstream bins: {report.summary()}")

    trl, trl_rows = run_trl(args, tokenizer, samples)
    ours_rows = [
        [{"input_ids": [d["input_ids"] for d in b], "labels": [d["labels"] for d in b]}] for b in bins
    ]
    ours = run_slipstream(args, tokenizer, ours_rows[:total], "slipstream")

    ratio = ours.tokens_per_s / trl.tokens_per_s
    print(f"\n{'arm':<12}{'tokens/s':>10}{'timed tokens':>14}{'seconds':>9}")
    for arm in (trl, ours):
        print(f"{arm.name:<12}{arm.tokens_per_s:>10.1f}{arm.timed_tokens:>14}{arm.timed_seconds:>9.2f}")
    print(
        f"\nslipstream / trl: {ratio:.2f}x  (target >= {TARGET}x: {'met' if ratio >= TARGET else 'NOT met'})"
    )
    print(f"\nloss, trl        (TRL's bins):        {curve(trl.losses)}")
    print(f"loss, slipstream (slipstream's bins): {curve(ours.losses)}")
    print(
        "  not step-aligned: the arms pack the same documents into different bins and orders; "
        f"mean over the timed steps: trl {sum(trl.losses[args.warmup :]) / args.steps:.4f}, "
        f"slipstream {sum(ours.losses[args.warmup :]) / args.steps:.4f}"
    )
    if not args.no_parity:
        parity = run_slipstream(args, tokenizer, [[row] for row in trl_rows], "parity")
        gap = max(abs(a - b) for a, b in zip(parity.losses, trl.losses, strict=True))
        print(f"loss, slipstream (TRL's bins, TRL's order): {curve(parity.losses)}")
        print(
            f"  on TRL's own rows slipstream runs {parity.tokens_per_s:.1f} tokens/s: "
            f"{parity.tokens_per_s / trl.tokens_per_s:.2f}x trl"
        )
        print(
            f"  parity with trl, step for step: max |diff| {gap:.2e} "
            f"({'agree' if gap <= PARITY_TOLERANCE else 'DISAGREE'} at {PARITY_TOLERANCE:g})"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
