"""``slipstream generate`` on its two engines, measured (issue 45): transformers' generate against vLLM.

The same model directory (or run, or adapter) and ``--prompts`` chat questions, greedy, up to
``--max-new-tokens``: the hf engine answers one prompt after another (as ``generate`` streams them),
the vLLM engine all of them in one call. Prints and writes (``--out``) each engine's load and start
seconds, answering seconds, generated tokens per second, and how many answers the two engines agree on
token for token (greedy: they differ only where float rounding flips a near-tie).

    python benchmarks/generate_engines.py --model MODEL_OR_RUN_DIR [--prompts 32] [--max-new-tokens 128]
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import torch

SUBJECTS = ["the sea", "a lighthouse", "autumn", "a train station", "bread", "the moon", "a library", "rain"]
ASKS = [
    "Write two sentences about {}.",
    "Give three facts about {}.",
    "Describe {} to a child.",
    "What would a poet say about {}?",
]


def questions(count: int) -> list[str]:
    every = [ask.format(subject) for subject in SUBJECTS for ask in ASKS]
    return [every[i % len(every)] for i in range(count)]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", required=True, help="a model directory, a run directory or an adapter")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--dtype", default=None, help="default: the run's (auto for a model directory)")
    parser.add_argument("--memory-share", type=float, default=0.3)
    parser.add_argument("--out", default=None, help="write the figures as JSON here")
    args = parser.parse_args()

    from slipstream.generation import EngineAnswers, load_generator

    prompts = questions(args.prompts)
    figures: dict = {
        "model": args.model,
        "prompts": len(prompts),
        "max_new_tokens": args.max_new_tokens,
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
        "threads": torch.get_num_threads(),
    }

    began = time.perf_counter()
    generator = load_generator(args.model, dtype=args.dtype)
    loaded = time.perf_counter() - began
    figures["dtype"] = str(next(generator.model.parameters()).dtype)
    began = time.perf_counter()
    hf = [generator.answer(p, max_new_tokens=args.max_new_tokens) for p in prompts]
    seconds = time.perf_counter() - began
    tokens = sum(a.new_tokens for a in hf)
    figures["hf"] = {
        "load_s": loaded,
        "answer_s": seconds,
        "tokens": tokens,
        "tokens_per_s": tokens / seconds,
    }
    print(
        f"hf: loaded in {loaded:.1f} s; {tokens} tokens in {seconds:.1f} s ({tokens / seconds:.1f} tokens/s)"
    )

    began = time.perf_counter()
    engine = EngineAnswers.start(generator, prompts, args.max_new_tokens, args.memory_share)
    started = time.perf_counter() - began
    try:
        began = time.perf_counter()
        found = engine.answers(
            prompts, max_new_tokens=args.max_new_tokens, sample=False, temperature=1.0, top_p=1.0, seed=0
        )
        seconds = time.perf_counter() - began
        peak = engine.engine.peak_memory_mb()
    finally:
        engine.close()
    tokens = sum(a.new_tokens for a in found)
    same = sum(a.text == b.text for a, b in zip(hf, found, strict=True))
    figures["vllm"] = {
        "start_s": started,
        "answer_s": seconds,
        "tokens": tokens,
        "tokens_per_s": tokens / seconds,
        "engine_peak_mb": peak,
    }
    figures["identical_answers"] = same
    figures["speedup_answering"] = figures["vllm"]["tokens_per_s"] / figures["hf"]["tokens_per_s"]
    print(
        f"vllm: started in {started:.1f} s; {tokens} tokens in {seconds:.1f} s ({tokens / seconds:.1f} tokens/s, "
        f"{figures['speedup_answering']:.2f}x hf); engine peak {peak:.0f} MB"
    )
    print(f"identical answers (greedy): {same} of {len(prompts)}")
    if args.out:
        with open(args.out, "w") as out:
            json.dump(figures, out, indent=2)


if __name__ == "__main__":  # vLLM may spawn processes
    main()
