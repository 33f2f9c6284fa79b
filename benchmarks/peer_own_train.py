"""A peer arm against the peer's own ``trainer.train()``: is the A/B's TRL arm the TRL users run?

The ``trl`` arm (SFT) and the ``trl-dpo`` arm (``--objective dpo``) of ``slipstream ab`` drive a real
``SFTTrainer`` / ``DPOTrainer`` one step at a time (``bench/peers/trl_step.py``,
``trl_dpo_step.py``): its collator, ``training_step``, optimizer, scheduler and clipping, but not its
dataloader, callbacks or logging. This script measures what that leaves out. Both runs below use the
A/B's own workload (the same options as ``slipstream ab``: model, data, LoRA, dtype, steps, seed),
the same packed plan (which rows form each step) and the same initial weights and adapter, each in a
fresh process, one after the other:

1. ``arm``: the harness's arm alone, as ``slipstream ab --arms trl`` (or ``trl-dpo``) runs it;
2. ``own``: the same trainer, built by the same code, then ``trainer.train()``: TRL's and the
   Trainer's own loop, over a dataloader yielding the plan's micro-batches in order (the Trainer's
   ``gradient_accumulation_steps`` = the run's ``--grad-accum``), a step timed from the Trainer's
   ``on_step_begin`` to its ``on_step_end`` (after the optimizer step; its logging comes after).

The two alternate (``--rounds``, default 2: arm, own, arm, own), so a slow phase of the machine touches
both. It prints each one's median step over every round's timed steps (warm-up excluded) and each
round's, the ratio, and the loss of every step side by side (the same training: they must agree), and
writes them as JSON (``--json``):

    python benchmarks/peer_own_train.py --model MODEL_DIR --data runs/data/pairs.jsonl --objective dpo \\
        --steps 8 --warmup 2 --lora-rank 16 --lora-targets q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj
    python benchmarks/peer_own_train.py --model MODEL_DIR --data runs/data/chats.jsonl --response-only \\
        --steps 12 --warmup 2 --lora-rank 16
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

# The arm of each objective and the peer trainer it drives.
ARM_OF_OBJECTIVE = {"sft": "trl", "dpo": "trl-dpo"}


def own_train(config_dict: dict, arm: str, plan: list, vocab_size: int) -> dict:
    """In a fresh process: the arm's model and trainer, then ``trainer.train()`` over the plan."""
    import torch
    from transformers import TrainerCallback

    from slipstream.bench.ab_config import ABConfig, resolve_device
    from slipstream.bench.arm_run import trl_peer_step
    from slipstream.bench.arms import build_arm_model

    config = ABConfig.from_dict(config_dict)
    device = resolve_device(config.ab.device)
    if config.ab.threads:
        torch.set_num_threads(config.ab.threads)
    model = build_arm_model(config, arm, vocab_size, device)
    peer = trl_peer_step(config, arm, model, device)  # the very trainer the arm drives
    keys = ("prompt_ids", "chosen_ids", "rejected_ids") if arm == "trl-dpo" else ("input_ids", "labels")
    rows = [{key: row[key] for key in keys} for step in plan for micro in step for row in micro]
    trainer = peer.trainer
    # the plan's micro-batches, in order: row indices per micro-batch
    groups, start = [], 0
    for step in plan:
        for micro in step:
            groups.append(list(range(start, start + len(micro))))
            start += len(micro)

    def plan_loader():  # one process: the Trainer moves each batch to the device itself (_prepare_inputs)
        return torch.utils.data.DataLoader(rows, batch_sampler=groups, collate_fn=trainer.data_collator)

    trainer.get_train_dataloader = plan_loader

    class StepClock(TrainerCallback):
        def __init__(self):
            self.step_s: list[float] = []
            self._started = 0.0

        def on_step_begin(self, args, state, control, **kwargs):
            if device == "cuda":
                torch.cuda.synchronize()
            self._started = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            if device == "cuda":
                torch.cuda.synchronize()
            self.step_s.append(time.perf_counter() - self._started)

    clock = StepClock()
    trainer.add_callback(clock)
    started = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - started
    losses = [float(entry["loss"]) for entry in trainer.state.log_history if "loss" in entry]
    peer.close()
    return {"step_s": clock.step_s, "loss": losses, "wall_s": wall}


def main(argv: list[str] | None = None) -> int:
    from slipstream.bench.command import ab_config_from_args, add_ab_arguments
    from slipstream.bench.runner import prepare_bins, run_arm, run_in_fresh_process

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_ab_arguments(parser)
    parser.add_argument("--json", help="write the figures here (JSON)")
    parser.add_argument(
        "--rounds",
        type=int,
        default=2,
        help="arm, own, arm, own, ...: each this many times (a slow phase of the machine then touches both)",
    )
    args = parser.parse_args(argv)
    arm = ARM_OF_OBJECTIVE[args.objective or "sft"]
    args.arms = arm
    config = ab_config_from_args(args)
    plan, vocab, _ = prepare_bins(config)
    config_dict = dataclasses.asdict(config)
    rounds: dict[str, list[dict]] = {"arm": [], "own": []}
    for _ in range(args.rounds):
        rounds["arm"].append(run_in_fresh_process(run_arm, config_dict, arm, plan, vocab))
        if "skipped" in rounds["arm"][0]:
            print(f"{arm}: skipped: {rounds['arm'][0]['skipped']}", file=sys.stderr)
            return 1
        rounds["own"].append(run_in_fresh_process(own_train, config_dict, arm, plan, vocab))
    timed = slice(config.ab.warmup, None)
    # every round's timed steps together; the loss curves of the first round
    medians = {
        name: statistics.median(s for run in done for s in run["step_s"][timed])
        for name, done in rounds.items()
    }
    per_round = {
        name: [statistics.median(run["step_s"][timed]) for run in done] for name, done in rounds.items()
    }
    runs = {name: done[0] for name, done in rounds.items()}
    if args.json:
        record = {
            "arm": arm,
            "config": config_dict,
            "median_step_s": medians,
            "per_round": per_round,
            "rounds": rounds,
        }
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(record, indent=1, default=str) + "\n")
    print(f"  the A/B's arm alone:       median step {medians['arm']:.3f} s (rounds: {per_round['arm']})")
    print(f"  TRL's own trainer.train(): median step {medians['own']:.3f} s (rounds: {per_round['own']})")
    print(
        f"{arm}, {config.ab.steps} steps ({config.ab.warmup} warm-up), model {config.model}, data {config.train.data.path}"
    )
    print(f"  the A/B's arm alone:       median step {medians['arm']:.3f} s (rounds: {per_round['arm']})")
    print(f"  TRL's own trainer.train(): median step {medians['own']:.3f} s (rounds: {per_round['own']})")
    print(f"  arm / own: {medians['arm'] / medians['own']:.3f}")
    print("  loss per step (arm | own):")
    for step, (a, b) in enumerate(zip(runs["arm"]["loss"], runs["own"]["loss"], strict=False)):
        print(f"    {step}: {float(a):.4f} | {float(b):.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
