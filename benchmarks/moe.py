"""MoE routing benchmark: full training steps, stock eager / stock grouped_mm / slipstream sorted.

Two CPU-sized shapes with the real routing: Qwen3-MoE (128 experts, top-8) and GPT-OSS
(32 experts, top-4), hidden 256, 2 layers. Three regimes:

- ``trainable``: every parameter trains, experts included;
- ``frozen``: experts (and everything else) frozen, PEFT LoRA on q/k/v/o — how QLoRA users train;
- ``4bit``: experts in NF4 (frozen), LoRA on q/k/v/o: slipstream's sorted routing
  (dequantizes the experts with tokens a chunk at a time, again in backward) vs the stock
  eager loop structure dequantizing each hit expert on its own (``naive_nf4_eager`` below).
  The naive loop uses slipstream's per-expert dequantizer, not bitsandbytes' CPU
  ``dequantize_4bit``, which returns wrong values for Qwen3-MoE's [256, 96] down_proj (a last
  dimension that is not a multiple of the blocksize); that makes it a faster baseline. It
  keeps every dense weight alive for backward, which is why its peak memory is higher.

Optimizer: AdamW, fused where torch has it for the device (the same in every arm).

Every arm uses slipstream's packed attention (so only the experts differ), runs in its own
process from the same weights on the same packed demo data, and must give the same losses.

    python benchmarks/moe.py [--tokens 1024 --steps 5 --warmup 1 --out runs/bench-moe]
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import resource
import statistics
import time
from pathlib import Path

import torch

ARMS = {
    "trainable": ("stock-eager", "stock-grouped_mm", "slipstream-sorted", "slipstream-sorted-loop"),
    "frozen": ("stock-eager", "stock-grouped_mm", "slipstream-sorted"),
    "4bit": ("naive-nf4-loop", "slipstream-sorted"),
}
TARGETS = {  # (regime, shape or None for all, baseline arm): minimum slipstream-sorted ratio
    ("trainable", "qwen3-moe-bench-cpu", "stock-eager"): 3.0,
    ("frozen", "qwen3-moe-bench-cpu", "stock-eager"): 1.2,
    ("trainable", None, "stock-grouped_mm"): 1.0,
    ("frozen", None, "stock-grouped_mm"): 1.0,
    ("4bit", None, "naive-nf4-loop"): 1.3,
}


def naive_nf4_eager(self, hidden_states, top_k_index, top_k_weights):
    """transformers' eager experts loop (a ``where`` per expert), dequantizing each hit expert."""
    stores = self.slipstream_nf4.stores
    first = "gate_up_proj" if self.has_gate else "up_proj"
    out = torch.zeros_like(hidden_states)
    with torch.no_grad():
        mask = torch.nn.functional.one_hot(top_k_index, num_classes=self.num_experts).permute(2, 1, 0)
        hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
    for expert in hit:
        expert = int(expert[0])
        top_k_pos, token_idx = torch.where(mask[expert])
        x = hidden_states[token_idx]
        w1 = stores[first].expert_weight(expert, x.dtype)
        h = x @ w1 if self.is_transposed else x @ w1.T
        if self.has_bias:
            h = h + self.gate_up_proj_bias[expert]
        h = self._apply_gate(h) if self.has_gate else self.act_fn(h)
        w2 = stores["down_proj"].expert_weight(expert, x.dtype)
        y = h @ w2 if self.is_transposed else h @ w2.T
        if self.has_bias:
            y = y + self.down_proj_bias[expert]
        out.index_add_(0, token_idx, (y * top_k_weights[token_idx, top_k_pos, None]).to(out.dtype))
    return out


def run_arm(
    shape: str,
    regime: str,
    arm: str,
    bins: list,
    vocab_size: int,
    steps: int,
    warmup: int,
    device: str = "cpu",
    dtype: str = "float32",
    layers: int | None = None,
) -> dict:
    import slipstream
    from slipstream.bench.counters import HostSyncCounter
    from slipstream.models import build_model
    from slipstream.moe.nf4 import quantize_experts

    experts_impl = {"stock-eager": "eager", "stock-grouped_mm": "grouped_mm"}.get(arm, "eager")
    model = (
        build_model(
            shape,
            vocab_size=vocab_size,
            layers=layers,
            seed=0,
            dtype=getattr(torch, dtype),
            experts_implementation=experts_impl,
        )
        .to(device)
        .train()
    )
    sorted_arm = arm.startswith("slipstream-sorted")
    slipstream.optimize(
        model,
        moe_routing="sorted" if sorted_arm else "stock",
        moe_compute="loop" if arm.endswith("-loop") else "auto",
    )
    if regime == "4bit":
        quantize_experts(model)
        if arm == "naive-nf4-loop":
            from transformers.integrations.moe import ExpertsInterface

            ExpertsInterface.register("naive_nf4_eager", naive_nf4_eager)
            model.set_experts_implementation("naive_nf4_eager")
    if regime in ("frozen", "4bit"):
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(
            model, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
        )
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-3, fused=True)
    step_s, losses, tokens, syncs = [], [], [], 0
    for step in range(steps):
        batch = slipstream.collate_packed(bins[step], device=device)
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        counter = HostSyncCounter() if step == 0 else None
        if counter:
            with counter:
                loss = model(**batch.model_inputs()).loss
                loss.backward()
            syncs = counter.total
        else:
            loss = model(**batch.model_inputs()).loss
            loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if device == "cuda":
            torch.cuda.synchronize()
        step_s.append(time.perf_counter() - start)
        losses.append(loss.item())
        tokens.append(batch.num_tokens)
    timed = slice(warmup, None)
    return {
        "shape": shape,
        "regime": regime,
        "arm": arm,
        "experts_implementation": model.config._experts_implementation,
        "tokens_per_s": sum(tokens[timed]) / sum(step_s[timed]),
        "median_step_s": statistics.median(step_s[timed]),
        "loss": losses,
        "host_syncs_per_step": syncs,
        "trainable_params": sum(p.numel() for p in params),
        "peak_memory_mb": (
            torch.cuda.max_memory_allocated() / 2**20
            if device == "cuda"
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        ),
    }


def main() -> int:
    from slipstream.atomic import write_text_atomically as write_atomically
    from slipstream.bench.fingerprint import describe, fingerprint
    from slipstream.bench.runner import run_in_fresh_process
    from slipstream.data import demo_samples, demo_tokenizer, pack_samples
    from slipstream.models import preset_vocab_size

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shapes", default="qwen3-moe-bench-cpu,gpt-oss-bench-cpu")
    parser.add_argument("--regimes", default="trainable,frozen,4bit")
    parser.add_argument("--tokens", type=int, default=1024, help="tokens per packed micro-batch")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=1, help="run every arm this many times, interleaved")
    parser.add_argument("--layers", type=int, default=None, help="shorten the shapes to N layers")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--out", default="runs/bench-moe")
    args = parser.parse_args()

    tokenizer = demo_tokenizer()
    bins, report = pack_samples(demo_samples(tokenizer, num_rows=600, seed=0), args.tokens, seed=0)
    bins = [[{"input_ids": d["input_ids"], "labels": d["labels"]} for d in b] for b in bins[: args.steps]]
    runs: dict[tuple[str, str, str], list[dict]] = {}
    for repeat in range(args.repeats):
        for shape in args.shapes.split(","):
            for regime in args.regimes.split(","):
                for arm in ARMS[regime]:
                    result = run_in_fresh_process(
                        run_arm,
                        shape,
                        regime,
                        arm,
                        bins,
                        preset_vocab_size(shape) or len(tokenizer),  # real vocabularies, never shrunk
                        args.steps,
                        args.warmup,
                        args.device,
                        args.dtype,
                        args.layers,
                    )
                    runs.setdefault((shape, regime, arm), []).append(result)
                    print(
                        f"[{repeat}] {shape:22s} {regime:9s} {arm:24s} {result['tokens_per_s']:8.0f} tok/s  "
                        f"syncs/step {result['host_syncs_per_step']:5d}  loss[-1] {result['loss'][-1]:.5f}",
                        flush=True,
                    )
    results = []
    for repeats in runs.values():  # the median repeat of each arm (by tokens/s)
        ordered = sorted(repeats, key=lambda r: r["tokens_per_s"])
        results.append(
            {**ordered[len(ordered) // 2], "tokens_per_s_all": [r["tokens_per_s"] for r in repeats]}
        )

    lines = [
        "| shape | regime | arm | tokens/s | vs stock eager | vs stock grouped_mm | host syncs/step (fwd+bwd) "
        "| peak memory (MB) | loss max rel diff |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    verdicts = []
    for shape in args.shapes.split(","):
        for regime in args.regimes.split(","):
            group = {r["arm"]: r for r in results if r["shape"] == shape and r["regime"] == regime}
            reference = group[ARMS[regime][0]]["loss"]
            for arm, r in group.items():
                worst = max(abs(a - b) / abs(b) for a, b in zip(r["loss"], reference, strict=True))
                ratios = [
                    f"{r['tokens_per_s'] / group[base]['tokens_per_s']:.2f}x" if base in group else "-"
                    for base in ("stock-eager", "stock-grouped_mm")
                ]
                if regime == "4bit":
                    ratios[0] = (
                        f"{r['tokens_per_s'] / group['naive-nf4-loop']['tokens_per_s']:.2f}x (vs naive 4-bit)"
                    )
                lines.append(
                    f"| {shape} | {regime} | {arm} | {r['tokens_per_s']:.0f} | {ratios[0]} | {ratios[1]} | "
                    f"{r['host_syncs_per_step']} | {r['peak_memory_mb']:.0f} | {worst:.1e} |"
                )
            for (t_regime, t_shape, base), target in TARGETS.items():
                if t_regime == regime and t_shape in (None, shape) and base in group:
                    ratio = group["slipstream-sorted"]["tokens_per_s"] / group[base]["tokens_per_s"]
                    verdicts.append(
                        f"- {shape} {regime}: slipstream-sorted / {base} = {ratio:.2f}x "
                        f"(target >= {target}x: {'met' if ratio >= target else 'NOT met'})"
                    )
    info = fingerprint()
    text = (
        "\n".join(
            [
                f"Machine: {describe(info)}",
                f"Data: {report.summary()}; {args.tokens} tokens per step, "
                f"{args.steps} steps ({args.warmup} warm-up), {args.dtype} on {args.device}, "
                f"median of {args.repeats} interleaved repeat(s)",
                "",
                *lines,
                "",
                *verdicts,
            ]
        )
        + "\n"
    )
    print("\n" + text)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_atomically(out / "moe.md", text)
    write_atomically(out / "moe.json", json.dumps({"fingerprint": info, "results": results}, indent=1))
    table = io.StringIO()
    writer = csv.DictWriter(
        table,
        fieldnames=["shape", "regime", "arm", "tokens_per_s", "host_syncs_per_step"],
        extrasaction="ignore",
    )
    writer.writeheader()
    writer.writerows(results)
    write_atomically(out / "moe.csv", table.getvalue())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
