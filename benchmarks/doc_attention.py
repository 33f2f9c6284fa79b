"""One packed attention layer, forward + backward: one call per document vs documents grouped,
and the short-document kernel against SDPA's flash kernel.

The layer is ``packed_sdpa_attention`` itself (the ``slipstream_docwise`` backend) on a packed
row, with Qwen3-0.6B's attention shape (16 query / 8 KV heads, head_dim 128) by default. Each
arm runs the same inputs; arms alternate within every repeat so a busy neighbour hurts both
alike; the median and the best of the repeats are printed, and the ratio per document / grouped.

    python benchmarks/doc_attention.py [--lengths 90x11] [--dtype bfloat16] [--threads 2]

``--lengths``: ``LxN`` terms joined by commas (``90x11``, ``512x2``, ``900x1,10x12``); ``chat``
draws 11 lengths of 70..100 tokens (seeded) and a padding document up to ``--row`` tokens.
``--arms``: grouping modes (``per_document``, ``grouped``, ``auto``), each with ``+sdpa`` to turn
the short-document kernel off (``packing/short_attention``), e.g. ``auto,auto+sdpa``.

    python benchmarks/doc_attention.py --kernels [--heads 9 --kv-heads 3 --head-dim 64]

``--kernels``: the kernels alone, no packing: a ``--row`` of documents of one length L
(32..384) as one batched call, SDPA (the CPU flash kernel) against the short-document kernel,
both dtypes; where their ratio crosses 1 sets ``SHORT_MAX_LEN``.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from slipstream.packing import collate_packed
from slipstream.packing.attention import packed_sdpa_attention
from slipstream.packing.grouping import GROUPING_CHOICE, document_groups
from slipstream.packing.short_attention import SHORT_KERNEL_CHOICE, short_causal_attention


def lengths_of(spec: str, row: int) -> list[int]:
    if spec == "chat":
        rng = random.Random(0)
        lengths = [rng.randint(70, 100) for _ in range(11)]
        return lengths + ([row - sum(lengths)] if row > sum(lengths) else [])
    lengths = []
    for term in spec.split(","):
        length, _, count = term.partition("x")
        lengths += [int(length)] * int(count or 1)
    return lengths


class Layer(torch.nn.Module):
    """What the attention function reads off its module: nothing but training mode."""


def _best_ms(fn, inputs, grad, repeats: int) -> float:
    for _ in range(2):
        fn(*inputs).backward(grad)
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        fn(*inputs).backward(grad)
        best = min(best, time.perf_counter() - started)
    return best * 1e3


def kernels(args) -> int:
    """SDPA against the short-document kernel on rows of equal-length documents."""

    def sdpa(q, k, v):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    def short(q, k, v):
        return short_causal_attention(q, k, v, args.head_dim**-0.5, None)

    print(
        f"H {args.heads}/{args.kv_heads}, D {args.head_dim}, row {args.row}, {args.threads} threads, best of {args.repeats}"
    )
    for dtype in (torch.bfloat16, torch.float32):
        for length in (32, 64, 96, 128, 160, 192, 256, 384):
            n = max(1, args.row // length)
            inputs = [
                torch.randn(n, heads, length, args.head_dim, dtype=dtype).requires_grad_()
                for heads in (args.heads, args.kv_heads, args.kv_heads)
            ]
            grad = torch.randn(n, args.heads, length, args.head_dim, dtype=dtype)
            flash_ms = _best_ms(sdpa, inputs, grad, args.repeats)
            short_ms = _best_ms(short, inputs, grad, args.repeats)
            print(
                f"  {str(dtype).removeprefix('torch.'):>8} L {length:3d} x {n:2d}: sdpa {flash_ms:7.2f} ms, "
                f"short kernel {short_ms:7.2f} ms, {flash_ms / short_ms:5.2f}x"
            )
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--lengths", default="chat")
    parser.add_argument("--row", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--arms", default="per_document,grouped,auto")
    parser.add_argument("--kernels", action="store_true", help="the kernels alone (see above)")
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    if args.kernels:
        return kernels(args)
    dtype = getattr(torch, args.dtype)
    lengths = lengths_of(args.lengths, args.row)
    batch = collate_packed([{"input_ids": [1] * n} for n in lengths])
    T = batch.num_tokens
    # the model's layout: [1, T, H, D] projections seen as [1, H, T, D]
    query = torch.randn(1, T, args.heads, args.head_dim, dtype=dtype).transpose(1, 2).requires_grad_()
    key = torch.randn(1, T, args.kv_heads, args.head_dim, dtype=dtype).transpose(1, 2).requires_grad_()
    value = torch.randn(1, T, args.kv_heads, args.head_dim, dtype=dtype).transpose(1, 2).requires_grad_()
    grad = torch.randn(1, T, args.heads, args.head_dim, dtype=dtype)
    arms = args.arms.split(",")
    layers = {arm: Layer().train() for arm in arms}
    for arm, layer in layers.items():
        GROUPING_CHOICE[layer] = arm.removesuffix("+sdpa")
        SHORT_KERNEL_CHOICE[layer] = not arm.endswith("+sdpa")

    def step(arm: str) -> float:
        started = time.perf_counter()
        out, _ = packed_sdpa_attention(layers[arm], query, key, value, None, slipstream_packed_batch=batch)
        out.backward(grad)
        query.grad = key.grad = value.grad = None
        return time.perf_counter() - started

    times: dict[str, list[float]] = {arm: [] for arm in arms}
    for arm in arms:
        step(arm)  # warm-up
    for _ in range(args.repeats):
        for arm in arms:
            times[arm].append(step(arm))

    print(
        f"row {T} tokens, {len(lengths)} documents ({args.lengths}), H {args.heads}/{args.kv_heads}, "
        f"D {args.head_dim}, {args.dtype}, {args.threads} threads, {args.repeats} repeats"
    )
    base = statistics.median(times[arms[0]])
    for arm in arms:
        groups = document_groups(batch, arm.removesuffix("+sdpa"), args.heads, args.kv_heads, args.head_dim)
        calls = len(lengths) if groups is None else len(groups.shapes)
        padding = 0.0 if groups is None else groups.padded_elements / groups.real_elements - 1
        median = statistics.median(times[arm])
        print(
            f"  {arm:>18}: {calls:3d} calls, padding {padding:6.1%}, median {median * 1e3:8.2f} ms, "
            f"best {min(times[arm]) * 1e3:8.2f} ms, {base / median:5.2f}x vs {arms[0]}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
