"""How the policy reaches vLLM, measured (issue 45): merged weights against a LoRA adapter.

For each ``grpo.vllm_sync`` mode: the engine started on the real model with a LoRA (the 7 projections,
the adapter moved before every round as a step would move it), then ``--rounds`` rounds of a sync and
a generation of ``--prompts`` x ``--generations`` completions (up to ``--max-new-tokens``); prints each
round's sync seconds, generated tokens per second, and the engine's log-prob mismatch with the
trainer on what it sampled; slipstream's own sampler on the same prompts for comparison.

    python benchmarks/vllm_sync.py --model MODEL_DIR [--modes merged,lora] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", required=True)
    parser.add_argument("--modes", default="merged,lora")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--memory-share", type=float, default=0.3)
    parser.add_argument("--out", default=None, help="write the figures as JSON here")
    args = parser.parse_args()

    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from slipstream.engines.vllm_engine import VLLMEngine
    from slipstream.rollouts import CachedSampler, Sampling

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    base = AutoModelForCausalLM.from_pretrained(args.model, dtype=getattr(torch, args.dtype))
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    torch.manual_seed(0)
    model = get_peft_model(
        base, LoraConfig(r=args.rank, lora_alpha=2 * args.rank, target_modules=targets)
    ).eval()
    questions = [
        "The stock room holds 14 boxes of bolts and 9 crates of nails. Then 5 boxes of bolts are used. "
        "How many boxes of bolts are there now? Put the number in <answer></answer>.",
        "A shelf has 23 jars of paint and 7 tins of varnish. 8 jars of paint arrive. How many jars of paint "
        "are there now? Put the number in <answer></answer>.",
    ]
    prompts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": questions[i % len(questions)]}],
            add_generation_prompt=True,
            tokenize=True,
        )
        for i in range(args.prompts)
    ]
    prompts = [p["input_ids"] if hasattr(p, "keys") else p for p in prompts]
    sampling = Sampling(temperature=1.0, max_new_tokens=args.max_new_tokens)
    stops = tuple(
        sorted(
            {
                tokenizer.eos_token_id,
                *(
                    [base.generation_config.eos_token_id]
                    if isinstance(base.generation_config.eos_token_id, int)
                    else base.generation_config.eos_token_id or []
                ),
            }
        )
    )

    def move_adapter(step: int) -> None:
        with torch.no_grad():
            generator = torch.Generator().manual_seed(step)
            for name, param in model.named_parameters():
                if "lora_B" in name:
                    param.add_(torch.randn(param.shape, generator=generator) * 1e-3)

    def mismatch(rollouts) -> tuple[float, float]:
        found = []
        for prompt, group in zip(prompts, rollouts.completions, strict=True):
            for completion in group:
                ids = torch.tensor([list(prompt) + completion.ids])
                with torch.no_grad():
                    logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
                mine = logits.log_softmax(-1).gather(1, torch.tensor(completion.ids)[:, None])[:, 0]
                found.append((mine - torch.tensor(completion.logprobs)).abs())
        every = torch.cat(found)
        return every.mean().item(), every.max().item()

    figures: dict = {"threads": torch.get_num_threads(), "dtype": args.dtype, "modes": {}}
    hf = CachedSampler(stops, tokenizer.pad_token_id or 0)
    rates = []
    for round_ in range(args.rounds):
        move_adapter(round_)
        with torch.no_grad():
            rollouts = hf.generate(model, prompts, args.generations, sampling, seed=round_)
        rates.append(rollouts.stats.tokens_per_s)
        print(
            f"hf round {round_}: {rollouts.stats.generated_tokens} tokens, {rollouts.stats.tokens_per_s:.1f} tokens/s",
            flush=True,
        )
    figures["hf_tokens_per_s"] = rates
    for mode in args.modes.split(","):
        engine = VLLMEngine(
            stops, max_model_len=1024, sync_mode=mode, memory_share=args.memory_share, lora_rank=args.rank
        )
        began = time.perf_counter()
        engine.start(model)
        started = time.perf_counter() - began
        rounds = []
        try:
            for round_ in range(args.rounds):
                move_adapter(round_)
                synced = time.perf_counter()
                engine.sync(model)
                sync_s = time.perf_counter() - synced
                rollouts = engine.generate(model, prompts, args.generations, sampling, seed=round_)
                mean, largest = mismatch(rollouts)
                rounds.append(
                    {
                        "sync_s": sync_s,
                        "generated_tokens": rollouts.stats.generated_tokens,
                        "generation_s": rollouts.stats.seconds,
                        "tokens_per_s": rollouts.stats.tokens_per_s,
                        "logp_difference_mean": mean,
                        "logp_difference_max": largest,
                    }
                )
                print(f"{mode} round {round_}: {json.dumps(rounds[-1])}", flush=True)
            peak = engine.peak_memory_mb()
        finally:
            engine.close()
        figures["modes"][mode] = {
            "start_s": started,
            "sync_bytes": engine.sync_bytes,
            "engine_peak_mb": peak,
            "rounds": rounds,
            "median_sync_s": statistics.median(r["sync_s"] for r in rounds),
            "median_tokens_per_s": statistics.median(r["tokens_per_s"] for r in rounds),
        }
    print(json.dumps(figures, indent=1))
    if args.out:
        with open(args.out, "w") as out:
            json.dump(figures, out, indent=1)


if (
    __name__ == "__main__"
):  # vLLM's engine is another process; the guard keeps spawned ones from rerunning this
    main()
