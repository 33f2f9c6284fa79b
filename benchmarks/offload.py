"""Checkpointing benchmark: off / recompute / offload / offload-double.

GPU (the real benchmark, run by gpu_check.sh): a Qwen3-8B-shaped model (random init, bf16,
``--layers`` of its 36, LoRA on q/k/v/o), packed demo batches of ``--tokens`` tokens; step
time, peak memory and per-step loss for each mode, each in its own process.
Targets: offload-double <= 1.03x recompute's step time and >= 3% faster than offload where
the copy is not already hidden; <= 0.5 GB over offload; identical loss.

CPU (``--accounting``): the activation bytes each mode keeps on the device at the end of
forward, on a tiny 8-layer Llama and the packing benchmark's Qwen3 (the offload modes run
their real schedule on a recording engine). Hardware-independent.

    python benchmarks/offload.py --accounting
    python benchmarks/offload.py --layers 8 --tokens 8192 --steps 6   # on a GPU
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

MODES = ("off", "recompute", "offload", "offload-double")


def accounting() -> str:
    import slipstream
    from slipstream.models import build_model, preset_vocab_size
    from slipstream.offload import RecordingEngine, device_activation_bytes, enable_checkpointing

    generator = torch.Generator().manual_seed(0)
    lines = ["| model | tokens | mode | activation bytes on device | vs off |", "|---|---:|---|---:|---:|"]
    for shape, layers, lengths in (("llama", 8, [600, 1000, 448]), ("qwen3-bench-cpu", 4, [600, 1000, 448])):
        docs = [{"input_ids": torch.randint(1, 500, (n,), generator=generator).tolist()} for n in lengths]
        figures = {}
        for mode in MODES:
            model = build_model(shape, layers=layers, vocab_size=preset_vocab_size(shape) or 512).train()
            slipstream.optimize(model)
            engine = RecordingEngine() if mode.startswith("offload") else None
            _, manager = enable_checkpointing(model, mode, engine=engine, min_offload_bytes=0)
            batch = slipstream.collate_packed(docs)
            figures[mode] = device_activation_bytes(model, batch.model_inputs(), manager)
        for mode, value in figures.items():
            lines.append(
                f"| {shape} ({layers} layers) | {sum(lengths)} | {mode} | {value:,} | "
                f"{value / figures['off']:.3f} |"
            )
    return "\n".join(lines)


def run_mode(
    mode: str, shape: str, layers: int, bins: list, vocab_size: int, steps: int, warmup: int
) -> dict:
    from peft import LoraConfig, get_peft_model

    import slipstream
    from slipstream.models import build_model

    model = build_model(shape, layers=layers, vocab_size=vocab_size, dtype=torch.bfloat16).cuda().train()
    slipstream.optimize(model, checkpointing=mode)
    policies = list(model.slipstream.policies)
    model = get_peft_model(
        model, LoraConfig(r=16, lora_alpha=32, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    )
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    torch.cuda.reset_peak_memory_stats()
    step_s, losses = [], []
    for step in range(steps):
        batch = slipstream.collate_packed(bins[step], device="cuda")
        torch.cuda.synchronize()
        start = time.perf_counter()
        loss = model(**batch.model_inputs()).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        step_s.append(time.perf_counter() - start)
        losses.append(loss.item())
    return {
        "mode": mode,
        "median_step_s": statistics.median(step_s[warmup:]),
        "loss": losses,
        "peak_gb": torch.cuda.max_memory_allocated() / 2**30,
        "policies": policies,
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--accounting", action="store_true", help="CPU: activation bytes per mode, no timing")
    parser.add_argument("--shape", default="qwen3-8b")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--out", default="runs/bench-offload")
    args = parser.parse_args()
    if args.accounting:
        print(accounting())
        return 0
    if not torch.cuda.is_available():
        print("benchmarks/offload.py times GPU offloading and needs CUDA; on a CPU run it with --accounting")
        return 2

    from slipstream.atomic import write_text_atomically as write_atomically
    from slipstream.bench.fingerprint import describe, fingerprint
    from slipstream.bench.runner import run_in_fresh_process
    from slipstream.data import demo_samples, demo_tokenizer, pack_samples
    from slipstream.models import preset_vocab_size

    tokenizer = demo_tokenizer()
    bins, _ = pack_samples(demo_samples(tokenizer, num_rows=3000, seed=0), args.tokens, seed=0)
    bins = [[{"input_ids": d["input_ids"], "labels": d["labels"]} for d in b] for b in bins[: args.steps]]
    results = {
        m: run_in_fresh_process(
            run_mode,
            m,
            args.shape,
            args.layers,
            bins,
            preset_vocab_size(args.shape) or len(tokenizer),
            args.steps,
            args.warmup,
        )
        for m in MODES
    }
    lines = [
        f"Machine: {describe(fingerprint())}",
        f"{args.shape} x {args.layers} layers, bf16, LoRA r=16, {args.tokens} tokens per step",
        "",
        "| mode | median step (s) | peak GB | loss[-1] |",
        "|---|---:|---:|---:|",
    ]
    for mode, r in results.items():
        lines.append(f"| {mode} | {r['median_step_s']:.4f} | {r['peak_gb']:.2f} | {r['loss'][-1]:.5f} |")
    double, single, recompute = results["offload-double"], results["offload"], results["recompute"]
    lines += [
        "",
        f"- offload-double / recompute step time: {double['median_step_s'] / recompute['median_step_s']:.3f} (target <= 1.03)",
        f"- offload-double vs offload: {1 - double['median_step_s'] / single['median_step_s']:.1%} faster (target >= 3%)",
        f"- offload-double extra memory over offload: {double['peak_gb'] - single['peak_gb']:.2f} GB (target <= 0.5)",
        f"- losses identical across modes: {len({tuple(r['loss']) for r in results.values()}) == 1}",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_atomically(out / "offload.md", text)
    write_atomically(out / "offload.json", json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
