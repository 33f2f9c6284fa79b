"""slipstream inside TRL's SFTTrainer: packed attention + PackedCollator, LoRA, the built-in demo chats.

TRL does what it always does (tokenizes the chat rows with the tokenizer's chat template,
truncates to ``max_length``, applies the LoRA config, runs the loop); slipstream packs each
batch of documents into one row and attends within each document. The loss is TRL's own fused
LM head (SFTTrainer 1.16 always installs it, and it reads ``lm_head.weight`` directly, so LoRA on
the head would not train here); slipstream's chunked loss applies under the HF Trainer
(examples/hf_trainer.py) and ``slipstream train``. CPU, a few seconds, no downloads:

    python examples/trl_sft.py [--steps 30] [--output-dir runs/trl-sft]
"""

from __future__ import annotations

import argparse

from datasets import Dataset
from peft import LoraConfig
from trl import SFTConfig, SFTTrainer

import slipstream
from slipstream.data import demo_rows, demo_tokenizer
from slipstream.models import build_model


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="demo", help="a slipstream.models preset (random init)")
    parser.add_argument("--rows", type=int, default=400, help="built-in demo chat rows")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--docs-per-row", type=int, default=8, help="documents packed into each batch row")
    parser.add_argument("--output-dir", default="runs/trl-sft")
    args = parser.parse_args()

    tokenizer = demo_tokenizer()
    model = build_model(args.model, vocab_size=len(tokenizer), seed=0)
    slipstream.optimize(model, packed_attention=True)  # before PEFT wraps it; same model, in place

    config = SFTConfig(
        output_dir=args.output_dir,
        max_steps=args.steps,
        max_length=512,  # TRL truncates each tokenized chat to this
        per_device_train_batch_size=args.docs_per_row,  # PackedCollator makes them one packed row
        learning_rate=5e-3,
        lr_scheduler_type="constant",
        bf16=False,  # SFTConfig defaults to bf16 autocast, slow on most CPUs
        activation_checkpointing=False,  # SFTConfig defaults to on; a tiny model does not need it
        use_cpu=True,
        logging_steps=5,
        save_strategy="no",
        report_to="none",
        seed=0,
    )
    trainer = SFTTrainer(
        model=model,
        args=config,
        train_dataset=Dataset.from_list(demo_rows(args.rows, seed=0)),  # {"messages": [...]} rows
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
