"""slipstream inside the plain HF Trainer: packed attention + PackedCollator on slipstream's own bins.

The demo chats are tokenized (response-only labels) and bin-packed best-fit-decreasing by
``slipstream.data.pack_samples``; each dataset row is one bin (a list of documents), so with
``per_device_train_batch_size=1`` every micro-batch is one full packed row. The Trainer
counts the label tokens of each step across gradient accumulation, so the loss stays
token-weighted; the loss itself is slipstream's chunked LM head + cross-entropy (on by default
in ``slipstream.optimize``: no [tokens, vocab] logits in training). CPU, a few seconds, no
downloads:

    python examples/hf_trainer.py [--steps 30] [--output-dir runs/hf-trainer]
"""

from __future__ import annotations

import argparse

from datasets import Dataset
from transformers import Trainer, TrainingArguments

import slipstream
from slipstream.data import demo_samples, demo_tokenizer, pack_samples
from slipstream.models import build_model


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="demo", help="a slipstream.models preset (random init)")
    parser.add_argument("--rows", type=int, default=400, help="built-in demo chat rows")
    parser.add_argument("--max-seq-len", type=int, default=1024, help="tokens per packed bin")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--grad-accum", type=int, default=2)
    parser.add_argument("--output-dir", default="runs/hf-trainer")
    args = parser.parse_args()

    tokenizer = demo_tokenizer()
    samples = demo_samples(tokenizer, num_rows=args.rows, seed=0, response_only=True)
    bins, report = pack_samples(samples, args.max_seq_len, seed=0)
    print(report.summary())
    rows = [{"input_ids": [d["input_ids"] for d in b], "labels": [d["labels"] for d in b]} for b in bins]

    model = build_model(args.model, vocab_size=len(tokenizer), seed=0)
    slipstream.optimize(model, packed_attention=True)

    trainer = Trainer(
        model=model,
        args=TrainingArguments(
            output_dir=args.output_dir,
            max_steps=args.steps,
            per_device_train_batch_size=1,  # one bin = one packed row per micro-batch
            gradient_accumulation_steps=args.grad_accum,
            learning_rate=3e-3,
            lr_scheduler_type="constant",
            use_cpu=True,
            logging_steps=5,
            save_strategy="no",
            report_to="none",
            seed=0,
        ),
        train_dataset=Dataset.from_list(rows),
        data_collator=slipstream.PackedCollator(),
    )
    result = trainer.train()
    losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    print(f"losses every 5 steps: {', '.join(f'{loss:.3f}' for loss in losses)}")
    print(
        f"{result.global_step} steps in {result.metrics['train_runtime']:.1f} s; policies: "
        f"{model.slipstream.policies}"
    )
    trainer.save_model(args.output_dir)
    print(f"model saved to {args.output_dir}/")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
