"""The compiled fused kernels (``fused_kernels="compiled"``, ``slipstream.fused.compiled``): each
kernel alone, and whole training steps with the two arms' steps interleaved in one process.

    python benchmarks/fused_kernels.py --kernels [--tokens 1015 --hidden 576 --inner 1536]

``--kernels``: RMSNorm, SwiGLU (and RoPE, which slipstream leaves eager) forward + backward on one
packed row, the stock eager formula against ``torch.compile`` of it (inductor, dynamic shapes),
best of 5; and each kernel's cold start in this process (run with an empty inductor cache,
``TORCHINDUCTOR_CACHE_DIR=$(mktemp -d)``, for the figure a new machine pays).

    python benchmarks/fused_kernels.py --model DIR --data FILE.jsonl [--steps 22 --dtype bfloat16]

Whole steps: the ``slipstream`` arm twice in one process, with ``fused_kernels`` off and
"compiled", the same bins and seed, one step of each in turn (the order alternating each
step), so the VM's minute-to-minute swings in matmul speed hit both alike (the A/B harness runs
each arm in its own process, where those swings drown a 15% difference). Prints the geometric
mean of the per-step time ratios and the loss of each step of both.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import torch

from slipstream.fused.compiled import rms_norm_formula, swiglu_formula


def _rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope_formula(q, k, cos, sin):
    """transformers' Llama ``apply_rotary_pos_emb`` (heads on dim 1)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _run(fn, args):
    out = fn(*args)
    outs = out if isinstance(out, tuple) else (out,)
    torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])


def _best_ms(fn, args, repeats: int = 5, calls: int = 10) -> float:
    for _ in range(3):
        _run(fn, args)
    best = math.inf
    for _ in range(repeats):
        began = time.perf_counter()
        for _ in range(calls):
            _run(fn, args)
        best = min(best, (time.perf_counter() - began) / calls)
    return best * 1e3


def kernels(args) -> None:
    dtype = getattr(torch, args.dtype)
    t, hidden, inner, heads, kv_heads, dim = (
        args.tokens,
        args.hidden,
        args.inner,
        args.heads,
        args.kv_heads,
        args.head_dim,
    )

    def grad(*shape):
        return torch.randn(*shape, dtype=dtype, requires_grad=True)

    cases = {
        "RMSNorm": (rms_norm_formula, (grad(1, t, hidden), grad(hidden), 1e-5)),
        "SwiGLU": (swiglu_formula, (grad(1, t, inner), grad(1, t, inner))),
        "RoPE (left eager)": (
            rope_formula,
            (
                grad(1, heads, t, dim),
                grad(1, kv_heads, t, dim),
                torch.randn(1, t, dim, dtype=dtype),
                torch.randn(1, t, dim, dtype=dtype),
            ),
        ),
    }
    print(f"forward + backward on {t} tokens, {args.dtype}, {torch.get_num_threads()} threads, best of 5")
    print("| kernel | eager (ms) | compiled (ms) | speedup | cold start (s) |")
    print("|---|---:|---:|---:|---:|")
    for name, (formula, inputs) in cases.items():
        eager = _best_ms(formula, inputs)
        began = time.perf_counter()
        compiled = torch.compile(formula, dynamic=True)
        _run(compiled, inputs)
        cold = time.perf_counter() - began
        fused = _best_ms(compiled, inputs)
        print(f"| {name} | {eager:.2f} | {fused:.2f} | {eager / fused:.2f}x | {cold:.1f} |")


def steps(args) -> None:
    from slipstream import optimize, state_of
    from slipstream.bench.arms import arm_speedups, build_arm_model, micro_batch_inputs
    from slipstream.bench.command import ab_config
    from slipstream.bench.runner import prepare_bins
    from slipstream.train.step import train_step

    config = ab_config(
        **dict(
            model=args.model,
            data=args.data,
            response_only=True,
            max_seq_len=args.max_seq_len,
            lora_rank=args.lora_rank,
            dtype=args.dtype,
            steps=args.steps,
            threads=args.threads,
            arms=("slipstream",),
        )
    )
    plan, vocab, _ = prepare_bins(config)
    arms = {}
    for kernels_mode in ("off", "compiled"):
        model = build_arm_model(config, "slipstream", vocab, "cpu")
        optimize(model, arm_speedups(config, "slipstream").replace(fused_kernels=kernels_mode))
        print(next(p for p in reversed(state_of(model).policies) if p.startswith("fused kernels")))
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
        micro = [[micro_batch_inputs("slipstream", docs, "cpu") for docs in step] for step in plan]
        began = time.perf_counter()
        losses = [train_step(model, micro[i], optimizer)["loss"] for i in range(args.warmup)]
        print(
            f"fused_kernels={kernels_mode}: {args.warmup} warm-up steps in {time.perf_counter() - began:.1f} s"
        )
        arms[kernels_mode] = (model, optimizer, micro, [], losses)
    order = list(arms.items())
    for index in range(args.warmup, len(plan)):
        for _, (model, optimizer, micro, times, losses) in order if index % 2 else order[::-1]:
            began = time.perf_counter()
            losses.append(train_step(model, micro[index], optimizer)["loss"])
            times.append(time.perf_counter() - began)
    off, on = arms["off"][3], arms["compiled"][3]
    ratios = [a / b for a, b in zip(off, on, strict=True)]
    geomean = math.exp(statistics.fmean(math.log(r) for r in ratios))
    print(
        f"{len(ratios)} step pairs: median step {statistics.median(off):.3f} s off, {statistics.median(on):.3f} s "
        f"compiled; compiled faster by {geomean:.3f}x (geometric mean of the ratios; "
        f"min {min(ratios):.2f}, max {max(ratios):.2f})"
    )
    for name, (*_, losses) in arms.items():
        print(f"losses ({name}):", " ".join(f"{loss:.4f}" for loss in losses))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--kernels", action="store_true", help="each kernel alone")
    parser.add_argument("--tokens", type=int, default=1015)
    parser.add_argument("--hidden", type=int, default=576, help="SmolLM2-135M's by default")
    parser.add_argument("--inner", type=int, default=1536)
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--model", help="a model directory (benchmarks/real_model.py prints SmolLM2's)")
    parser.add_argument("--data", help="a chat JSONL file (benchmarks/make_chats.py)")
    parser.add_argument("--steps", type=int, default=22)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--max-seq-len", type=int, default=1024)
    parser.add_argument("--lora-rank", type=int, default=16)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.kernels:
        kernels(args)
    elif args.model and args.data:
        steps(args)
    else:
        parser.error("--kernels, or --model and --data")


if __name__ == "__main__":
    main()
