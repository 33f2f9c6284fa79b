"""Multi-turn tool-calling rollouts, measured (issue 46): each trajectory's KV cache kept across its turns
against asking the engine turn by turn with the whole trajectory so far (what TRL's tool loop does without
vLLM), and vLLM turn by turn (its prefix cache).

The model (``--model``: a merged chat model, e.g. examples/agent-sft.yaml's warm start after
``slipstream export``), examples/agent.yaml's environment and prompts, ``--prompts`` x ``--generations``
trajectories per round, the same seeds in every arm. Prints and writes (``--out``) per arm: prefill and
generated tokens (hardware-independent), seconds, generated tokens per second, turns and tool calls per
trajectory.

    python benchmarks/agent_rollouts.py --model runs/agent-sft-merged [--arms kept,turns,vllm] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent


class TurnByTurn:
    """The sampler, asked turn by turn (it cannot continue a row in place): each later turn prefilled whole."""

    continues_turns = False

    def __init__(self, engine):
        self.engine = engine

    def sync(self, model):
        self.engine.sync(model)

    def generate(self, model, prompts, num_generations, sampling, seed):
        return self.engine.generate(model, prompts, num_generations, sampling, seed)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", required=True)
    parser.add_argument("--config", default=str(ROOT / "examples" / "agent.yaml"))
    parser.add_argument("--arms", default="kept,turns")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--memory-share", type=float, default=0.3)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from slipstream.objectives.grpo_agents import AgentPlan, load_toolset
    from slipstream.objectives.grpo_engines import stop_ids
    from slipstream.rollouts import CachedSampler, Sampling
    from slipstream.train.config import load_config
    from slipstream.train.precision import resolve_dtype

    config = load_config(args.config, [f"model.path={args.model}"])
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    tokenizer.chat_template = Path(config.data.chat_template).read_text()
    dtype = resolve_dtype(args.dtype, torch.device("cpu"))[0]
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).eval()
    toolset = load_toolset(config.grpo)
    room = config.data.max_seq_len - config.grpo.max_new_tokens
    plan = AgentPlan.make(
        toolset, tokenizer, config.grpo.max_tool_calling_iterations, config.data.max_seq_len, room
    )
    from slipstream.data.prompts import load_prompts

    rows, _ = load_prompts(config.data.path, tokenizer, room=room, tools=plan.schema)
    s = config.grpo
    sampling = Sampling(s.temperature, s.top_p, s.top_k, s.max_new_tokens)
    sampler = CachedSampler(stop_ids(tokenizer, model), int(tokenizer.pad_token_id or 0))
    figures: dict = {
        "model": args.model,
        "dtype": str(dtype),
        "prompts": args.prompts,
        "generations": args.generations,
        "rounds": args.rounds,
        "max_new_tokens": s.max_new_tokens,
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
        "threads": torch.get_num_threads(),
        "arms": {},
    }
    for arm in args.arms.split(","):
        engine = None
        if arm == "kept":
            engine = sampler
        elif arm == "turns":
            engine = TurnByTurn(sampler)
        elif arm == "vllm":
            from slipstream.engines.vllm_engine import VLLMEngine

            engine = VLLMEngine(
                stop_ids=stop_ids(tokenizer, model),
                max_model_len=config.data.max_seq_len,
                memory_share=args.memory_share,
            )
            print(f"vllm: {engine.start(model)}", file=sys.stderr)
        else:
            raise SystemExit(f"unknown arm {arm!r} (kept, turns, vllm)")
        found = []
        try:
            for number in range(args.rounds):
                batch = rows[number * args.prompts : (number + 1) * args.prompts]
                with torch.no_grad():
                    out = plan.rollouts(engine, model, batch, args.generations, sampling, 1000 + number)
                every = [t for row in out.trajectories for t in row]
                found.append(
                    {
                        "seconds": out.stats.seconds,
                        "prefill_tokens": out.stats.prefill_tokens,
                        "generated_tokens": out.stats.generated_tokens,
                        "model_tokens": sum(sum(t.model_mask) for t in every),
                        "tool_calls_per_trajectory": statistics.fmean(t.calls for t in every),
                        "turns_per_trajectory": statistics.fmean(t.turns for t in every),
                        "tool_s": sum(t.tool_s for t in every),
                    }
                )
                print(f"{arm} round {number + 1}: {json.dumps(found[-1])}", file=sys.stderr)
        finally:
            if arm == "vllm":
                engine.close()
        totals = {
            k: sum(r[k] for r in found)
            for k in ("seconds", "prefill_tokens", "generated_tokens", "model_tokens")
        }
        totals["model_tokens_per_s"] = totals["model_tokens"] / totals["seconds"]
        totals["rounds"] = found
        figures["arms"][arm] = totals
        print(
            f"{arm}: {totals['model_tokens']} sampled tokens in {totals['seconds']:.1f} s "
            f"({totals['model_tokens_per_s']:.1f}/s), {totals['prefill_tokens']} prefilled"
        )
    if args.out:
        Path(args.out).write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":  # vLLM may spawn processes
    main()
