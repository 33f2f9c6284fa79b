"""slipstream inside the plain HF Trainer: packed attention + PackedCollator on slipstream's own bins.

The chats (the built-in demo chats, or ``--data``: a chat JSONL file) are tokenized with
response-only labels and bin-packed best-fit-decreasing by ``slipstream.data.pack_samples``;
each dataset row is one bin (a list of documents), so with ``per_device_train_batch_size=1``
every micro-batch is one full packed row. The Trainer counts the label tokens of each step
across gradient accumulation, so the loss stays token-weighted; the loss itself is slipstream's
chunked LM head + cross-entropy (on by default in ``slipstream.optimize``: no [tokens, vocab]
logits in training). ``--model`` is a slipstream.models preset (random init, trained in full,
with the demo tokenizer); CPU, a few seconds, no downloads:

    python examples/hf_trainer.py [--steps 30] [--output-dir runs/hf-trainer]

or a local model directory (real weights, its own tokenizer and chat template), which trains a
LoRA adapter (PEFT) on top of it; on SmolLM2-135M-Instruct, about a minute on a CPU:

    python examples/hf_trainer.py --model $(python benchmarks/real_model.py) \
        --data examples/data/chats.jsonl --steps 20 --max-seq-len 512 --lr 5e-4
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from datasets import Dataset
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer, Trainer, TrainingArguments

import slipstream
from slipstream.data import demo_samples, demo_tokenizer, load_samples, pack_samples
from slipstream.models import build_model


def load_model(name: str):
    """``(model, tokenizer)``: a local model directory as saved, or a preset with the demo tokenizer."""
    if Path(name).is_dir():
        tokenizer = AutoTokenizer.from_pretrained(name, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(name, local_files_only=True, dtype=torch.float32)
        return model, tokenizer
    tokenizer = demo_tokenizer()
    return build_model(name, vocab_size=len(tokenizer), seed=0), tokenizer


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="demo", help="a slipstream.models preset or a model directory")
    parser.add_argument("--data", default=None, help="a chat JSONL file (default: the built-in demo chats)")
    parser.add_argument("--rows", type=int, default=400, help="built-in demo chat rows")
    parser.add_argument("--max-seq-len", type=int, default=1024, help="tokens per packed bin")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--grad-accum", type=int, default=2)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--log-every", type=int, default=5, help="steps per logged loss")
    parser.add_argument("--output-dir", default="runs/hf-trainer")
    args = parser.parse_args(argv)

    model, tokenizer = load_model(args.model)
    if args.data:  # tokenized with the tokenizer's chat template, the assistant turns labelled
        samples, _ = load_samples(args.data, tokenizer, response_only=True)
    else:
        samples = demo_samples(tokenizer, num_rows=args.rows, seed=0, response_only=True)
    bins, report = pack_samples(samples, args.max_seq_len, seed=0)
    print(report.summary())
    rows = [{"input_ids": [d["input_ids"] for d in b], "labels": [d["labels"] for d in b]} for b in bins]

    slipstream.optimize(model, packed_attention=True)  # before PEFT wraps it; same model, in place
    if Path(args.model).is_dir():  # real weights: train a LoRA adapter, not the whole model
        model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules=["q_proj", "v_proj"]))

    trainer = Trainer(
        model=model,
        args=TrainingArguments(
            output_dir=args.output_dir,
            max_steps=args.steps,
            per_device_train_batch_size=1,  # one bin = one packed row per micro-batch
            gradient_accumulation_steps=args.grad_accum,
            learning_rate=args.lr,
            lr_scheduler_type="constant",
            use_cpu=True,
            logging_steps=args.log_every,
            save_strategy="no",
            report_to="none",
            seed=0,
        ),
        train_dataset=Dataset.from_list(rows),
        data_collator=slipstream.PackedCollator(),
    )
    result = trainer.train()
    losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    print(f"losses every {args.log_every} steps: {', '.join(f'{loss:.3f}' for loss in losses)}")
    print(
        f"{result.global_step} steps in {result.metrics['train_runtime']:.1f} s; policies: "
        f"{model.slipstream.policies}"
    )
    trainer.save_model(args.output_dir)
    print(f"{'adapter' if Path(args.model).is_dir() else 'model'} saved to {args.output_dir}/")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
