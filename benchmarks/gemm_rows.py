"""What one row costs in the model's projection GEMMs, as the row count M of a packed micro-batch varies.

Why: a packed reward-model step shares each pair's prompt and so runs fewer tokens (1,183 instead of
1,944 at ``--preset reward``), yet measured 1.33x where the token ratio is 1.64x. On the 2-core AMX VM
oneDNN's bf16 matmul runs the shapes that reduce over the MLP's 1,536-wide intermediate (``down_proj``
forward, ``gate_proj`` / ``up_proj`` input gradient) on one thread for M in about 768..1,280 rows and
on both from about 1,408: per row the short micro-batch pays nearly twice. This prints the time per
row (microseconds) for each of the four GEMM shapes of an MLP, by M, on ``--threads`` threads, so the
range can be checked on another CPU.

    python benchmarks/gemm_rows.py [--hidden 576 --intermediate 1536] [--threads 2] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import time

import torch


def median_ms(fn, repeats: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2] * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=576, help="SmolLM2-135M's width")
    parser.add_argument("--intermediate", type=int, default=1536)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--rows", default="512,768,1024,1183,1280,1408,1536,1944,2048,2560")
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    up = torch.randn(args.intermediate, args.hidden, dtype=dtype)  # gate_proj / up_proj weight [out, in]
    down = torch.randn(args.hidden, args.intermediate, dtype=dtype)
    print(f"{torch.__version__}, {args.threads} threads, {args.dtype}; microseconds per row")
    print("rows  up fwd  down fwd  up bwd (dx)  down bwd (dx)  total")
    for rows in (int(r) for r in args.rows.split(",")):
        x = torch.randn(rows, args.hidden, dtype=dtype)
        h = torch.randn(rows, args.intermediate, dtype=dtype)
        shapes = (
            lambda x=x: torch.nn.functional.linear(x, up),
            lambda h=h: torch.nn.functional.linear(h, down),
            lambda h=h: h @ up,
            lambda x=x: x @ down,
        )
        per_row = [median_ms(fn, args.repeats) / rows * 1e3 for fn in shapes]
        print(f"{rows:5d}  " + "  ".join(f"{v:6.2f}" for v in per_row) + f"  {sum(per_row):6.2f}")


if __name__ == "__main__":
    main()
