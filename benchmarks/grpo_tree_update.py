"""GRPO's update on one micro-batch, one prompt a group against prefix trees (issue 47, GRPO trajectories).

A controlled shape, so the two layouts run exactly the same completions: 2 prompts under one shared
system prompt with tool schemas (``--system`` tokens, then ``--own`` tokens of their own), G = 8
trajectories each, of which ``--sharing`` make the same first tool call and read the same result
(``--call`` + ``--result`` tokens) before they branch (15-45 tokens more), the others answering at once
(40-100 tokens). Token ids are random; the model is real (its width, its vocabulary), LoRA r16 on the 7
projections, bf16 where the CPU has it. Each layout's forward + backward of every completion token's
log-prob (``answer_sums``, the update's forward) is timed alternately, after a warm-up; beside the times,
each layout's log-probs against the same ones computed in fp32 (bf16 rounds differently in any layout).

    python benchmarks/grpo_tree_update.py --model ~/.cache/slipstream/models/smollm2-135m-instruct
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch


def make_groups(args, vocab: int) -> list[dict]:
    rng = random.Random(args.seed)

    def ids(n: int) -> list[int]:
        return [rng.randrange(100, vocab) for _ in range(n)]

    system = ids(args.system)
    groups = []
    for _ in range(args.prompts):
        call, result = ids(args.call), ids(args.result)
        completions = [
            call + result + ids(rng.randrange(15, 45)) if j < args.sharing else ids(rng.randrange(40, 100))
            for j in range(args.generations)
        ]
        groups.append({"prompt_ids": system + ids(args.own), "completions": completions})
    return groups


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--system", type=int, default=165)
    parser.add_argument("--own", type=int, default=10)
    parser.add_argument("--sharing", type=int, default=5)
    parser.add_argument("--call", type=int, default=30)
    parser.add_argument("--result", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    import slipstream
    from slipstream.objectives.answers import answer_sums
    from slipstream.packing.completions import collate_completion_trees, collate_completions, completion_trees
    from slipstream.train.precision import resolve_dtype

    dtype, dtype_line = resolve_dtype("auto", torch.device("cpu"))
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    torch.manual_seed(args.seed)
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules=targets))
    model = slipstream.optimize(model).train()
    groups = make_groups(args, model.config.vocab_size)
    layouts = {
        "one prompt a group": collate_completions(groups).batch,
        "prefix trees": collate_completion_trees(groups, completion_trees(groups)).batch,
    }

    def step(batch) -> torch.Tensor:
        model.zero_grad(set_to_none=True)
        logp = answer_sums(model, batch, True)
        logp.sum().backward()
        return logp.detach().float()

    found = {name: step(batch) for name, batch in layouts.items()}  # warm-up, and the log-probs
    times: dict[str, list[float]] = {name: [] for name in layouts}
    for _ in range(args.repeats):
        for name, batch in layouts.items():
            started = time.perf_counter()
            step(batch)
            times[name].append(time.perf_counter() - started)
    first, second = found.values()
    # each layout's distance to the same log-probs in fp32 (bf16 rounds differently in every layout)
    model.float()
    with torch.no_grad():
        exact = answer_sums(model, layouts["one prompt a group"], True).float()
    medians = {name: statistics.median(t) for name, t in times.items()}
    record = {
        "dtype": dtype_line,
        "shape": vars(args),
        "tokens": {name: b.num_tokens for name, b in layouts.items()},
        "documents": {name: len(b.seq_lens) for name, b in layouts.items()},
        "median_s": medians,
        "speedup": medians["one prompt a group"] / medians["prefix trees"],
        "max_logp_difference_between_layouts": (first - second).abs().max().item(),
        "against_fp32": {
            name: {"max": (logp - exact).abs().max().item(), "mean": (logp - exact).abs().mean().item()}
            for name, logp in found.items()
        },
    }
    print(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
