"""slipstream inside TRL's SFTTrainer: packed attention + PackedCollator, LoRA, chat rows.

TRL does what it always does (tokenizes the chat rows with the tokenizer's chat template,
truncates to ``max_length``, applies the LoRA config, runs the loop); slipstream packs each
batch of documents into one row and attends within each document. The loss is TRL's own fused
LM head (SFTTrainer 1.16 always installs it, and it reads ``lm_head.weight`` directly, so LoRA on
the head would not train here); slipstream's chunked loss applies under the HF Trainer
(examples/hf_trainer.py) and ``slipstream train``. CPU, a few seconds, no downloads:

    python examples/trl_sft.py [--steps 30] [--output-dir runs/trl-sft]

``--model`` is a slipstream.models preset (random init, the demo tokenizer) or a local model
directory (real weights, its own tokenizer and chat template); ``--data`` a chat JSONL file
(``{"messages": [...]}`` rows) instead of the built-in demo chats. On SmolLM2-135M-Instruct,
under a minute on a CPU:

    python examples/trl_sft.py --model $(python benchmarks/real_model.py) \
        --data examples/data/chats.jsonl --steps 20 --docs-per-row 4 --lr 5e-4
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from datasets import Dataset
from peft import LoraConfig
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import SFTConfig, SFTTrainer

import slipstream
from slipstream.bench.peers.trl_base import checkpointing_argument
from slipstream.data import demo_rows, demo_tokenizer, read_rows
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
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--lr", type=float, default=5e-3)
    parser.add_argument("--docs-per-row", type=int, default=8, help="documents packed into each batch row")
    parser.add_argument("--log-every", type=int, default=5, help="steps per logged loss")
    parser.add_argument("--output-dir", default="runs/trl-sft")
    args = parser.parse_args(argv)

    model, tokenizer = load_model(args.model)
    slipstream.optimize(model, packed_attention=True)  # before PEFT wraps it; same model, in place
    rows = [row for row, _ in read_rows(args.data)] if args.data else demo_rows(args.rows, seed=0)

    config = SFTConfig(
        output_dir=args.output_dir,
        max_steps=args.steps,
        max_length=512,  # TRL truncates each tokenized chat to this
        per_device_train_batch_size=args.docs_per_row,  # PackedCollator makes them one packed row
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        bf16=False,  # SFTConfig defaults to bf16 autocast, slow on most CPUs
        # SFTConfig defaults to checkpointing on; a tiny model does not need it (the argument is
        # activation_checkpointing since transformers renamed it, gradient_checkpointing on 5.17)
        **{checkpointing_argument(SFTConfig): False},
        use_cpu=True,
        logging_steps=args.log_every,
        save_strategy="no",
        report_to="none",
        seed=0,
    )
    trainer = SFTTrainer(
        model=model,
        args=config,
        train_dataset=Dataset.from_list(rows),  # {"messages": [...]} rows, rendered by the chat template
        processing_class=tokenizer,
        data_collator=slipstream.PackedCollator(),
        peft_config=LoraConfig(r=16, lora_alpha=32, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
    )
    result = trainer.train()
    losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    print(f"losses every {config.logging_steps} steps: {', '.join(f'{loss:.3f}' for loss in losses)}")
    print(
        f"{result.global_step} steps in {result.metrics['train_runtime']:.1f} s; policies: "
        f"{trainer.model.slipstream.policies}"
    )
    trainer.save_model(args.output_dir)
    print(f"adapter saved to {args.output_dir}/")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
