"""The LM head + loss on a real vocabulary: stock loss vs TRL's fused LM head vs slipstream's chunked loss.

One packed step (forward + backward) of a model under ``slipstream.optimize`` (packed
attention, LoRA on q/k/v/o), the same weights, batch and adapter in every arm; only the loss
differs:

- ``stock``: transformers' loss on the full [tokens, vocab] logits (``chunked_loss=False``);
- ``trl``: TRL 1.16's fused LM head (``trl.trainer.utils.add_fused_lm_head``, what its
  SFTTrainer installs), called with ``fused_lm_head=True``;
- ``chunked``: slipstream's chunked LM head + loss (the default of ``optimize``).

Each (arm, labelled share, dtype) runs in a fresh process: warm-up steps, then timed steps.
Figures: median step time, and the extra memory of a step (CPU: peak RSS during the step
minus RSS before it, VmHWM reset per step; CUDA: peak allocated minus allocated before),
and the loss, which must agree across arms. ``--labelled 0.5`` masks the first half of every
document (its prompt, as in response-only chat SFT).

    python benchmarks/chunked_loss.py                       # qwen3-bench-cpu, vocab 151,936, 4,096 tokens
    python benchmarks/chunked_loss.py --device cuda --model qwen3-8b --layers 4 --tokens 16384 \\
        --dtypes bfloat16 --labelled 1.0                      # the GPU check

Targets (issue 9, qwen3-bench-cpu, 4,096 tokens): extra memory <= 1.5 GB with every position
labelled; half labelled: step <= 0.6x the stock loss's; every position labelled: no slower.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ARMS = ("stock", "trl", "chunked")
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]


def documents(tokens: int, labelled: float, seed: int) -> list[dict]:
    """Built-in demo documents filling ``tokens``; the first (1 - labelled) of each masked as its prompt."""
    from slipstream.bench.ceiling import ceiling_docs

    docs = ceiling_docs(tokens, seed)
    for doc in docs:
        prompt = round(len(doc["input_ids"]) * (1.0 - labelled))
        doc["labels"] = [-100] * prompt + doc["input_ids"][prompt:]
    return docs


def run_arm(arm: str, args_dict: dict, docs: list[dict], dtype_name: str) -> dict:
    """Build the model for ``arm`` and time ``warmup + steps`` forward + backward passes."""
    import torch
    from peft import LoraConfig, get_peft_model

    import slipstream
    from slipstream.bench.ceiling import proc_status_kib
    from slipstream.models import build_model, preset_vocab_size

    args = argparse.Namespace(**args_dict)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    vocab = preset_vocab_size(args.model)
    model = build_model(args.model, vocab_size=vocab, layers=args.layers, dtype=getattr(torch, dtype_name))
    model.to(device).train()
    slipstream.optimize(model, chunked_loss=arm == "chunked", loss_chunk_tokens=args.chunk_tokens)
    if arm == "trl":
        from trl.trainer.utils import add_fused_lm_head

        add_fused_lm_head(model)
    torch.manual_seed(0)
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules=LORA_TARGETS))
    batch = slipstream.collate_packed(docs, device=device)
    inputs = batch.model_inputs(num_items_in_batch=torch.tensor(float(batch.num_label_tokens), device=device))
    if arm == "trl":
        inputs["fused_lm_head"] = True
    times, extra, losses = [], [], []
    for step in range(args.warmup + args.steps):
        model.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        else:
            with open("/proc/self/clear_refs", "w") as refs:
                refs.write("5")  # VmHWM := VmRSS, so the peak below is this step's
            before = proc_status_kib("VmRSS") * 1024
        start = time.perf_counter()
        loss = model(**inputs).loss
        loss.backward()
        if device.type == "cuda":
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated()
        else:
            peak = proc_status_kib("VmHWM") * 1024
        if step >= args.warmup:
            times.append(time.perf_counter() - start)
            extra.append(peak - before)
        losses.append(float(loss))
    state = model.slipstream
    return {
        "arm": arm,
        "dtype": dtype_name,
        "median_step_s": statistics.median(times),
        "step_s": times,
        "extra_gb": max(extra) / 1e9,
        "loss": losses[-1],
        "tokens": batch.num_tokens,
        "label_tokens": batch.num_label_tokens,
        "vocab_size": vocab,
        "policies": [p for p in state.policies if "loss" in p],
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="qwen3-bench-cpu", help="a preset with a real vocabulary")
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--tokens", type=int, default=4096, help="tokens in the packed step")
    parser.add_argument("--labelled", default="1.0,0.5", help="shares of each document labelled")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--arms", default=",".join(ARMS))
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=1, help="each arm this many times (fresh processes)")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--chunk-tokens", type=int, default=None, help="override the chunked loss's chunk")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", default="runs/bench-chunked-loss")
    args = parser.parse_args()

    from slipstream.atomic import write_text_atomically as write_atomically
    from slipstream.bench.fingerprint import describe, fingerprint
    from slipstream.bench.runner import run_in_fresh_process
    from slipstream.models import preset_vocab_size

    if preset_vocab_size(args.model) is None:
        print(f"--model {args.model}: not a preset with a real vocabulary", file=sys.stderr)
        return 2
    arms = [a for a in args.arms.split(",") if a]
    results = []
    for labelled in map(float, args.labelled.split(",")):
        docs = documents(args.tokens, labelled, seed=0)
        for dtype in args.dtypes.split(","):
            runs = {arm: [] for arm in arms}
            for _ in range(args.repeats):
                for arm in arms:  # interleaved
                    runs[arm].append(run_in_fresh_process(run_arm, arm, vars(args), docs, dtype))
            for arm, repeats in runs.items():
                merged = dict(repeats[0], labelled=labelled)
                merged["step_s"] = [s for r in repeats for s in r["step_s"]]
                merged["median_step_s"] = statistics.median(merged["step_s"])
                merged["extra_gb"] = max(r["extra_gb"] for r in repeats)
                results.append(merged)
                print(
                    f"{arm:8s} {dtype:9s} labelled {labelled:.0%}: step {merged['median_step_s']:.2f} s, "
                    f"extra {merged['extra_gb']:.2f} GB, loss {merged['loss']:.6f}",
                    flush=True,
                )
    first = results[0]
    lines = [
        f"Machine: {describe(fingerprint())}",
        f"{args.model}"
        + (f" x {args.layers} layers" if args.layers else "")
        + f", vocabulary {first['vocab_size']:,}, LoRA r=16 on q/k/v/o, one packed step of {args.tokens:,} "
        f"tokens, {args.steps} timed steps after {args.warmup} warm-up, {args.repeats} repeat(s)",
        "",
        "| dtype | labelled | arm | label tokens | median step (s) | vs stock | extra memory (GB) | loss |",
        "|---|---:|---|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        stock = next(
            (
                s
                for s in results
                if s["arm"] == "stock" and s["dtype"] == r["dtype"] and s["labelled"] == r["labelled"]
            ),
            None,
        )
        ratio = f"{r['median_step_s'] / stock['median_step_s']:.2f}x" if stock else "-"
        lines.append(
            f"| {r['dtype']} | {r['labelled']:.0%} | {r['arm']} | {r['label_tokens']:,} | {r['median_step_s']:.2f} | "
            f"{ratio} | {r['extra_gb']:.2f} | {r['loss']:.6f} |"
        )
    chunked_policies = next((r["policies"] for r in results if r["arm"] == "chunked"), [])
    lines += ["", "Chunked-loss policies: " + "; ".join(chunked_policies)]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    command = "python benchmarks/chunked_loss.py " + " ".join(sys.argv[1:])
    write_atomically(out / "chunked_loss.md", f"`{command}`\n\n" + "\n".join(lines) + "\n")
    write_atomically(
        out / "chunked_loss.json", json.dumps({"args": vars(args), "results": results}, indent=1)
    )
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
