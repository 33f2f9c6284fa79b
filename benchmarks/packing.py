"""Packed-attention benchmark: tokens/s of full training steps, slipstream vs the two stock layouts.

Qwen3-shaped model (``qwen3-bench-cpu``: hidden 256, 4 layers, 4 query / 2 KV heads, head_dim
128, Qwen3's real vocabulary of 151,936), the built-in long-tailed SFT lengths packed into 2048-token bins,
forward + backward + AdamW. Arms: stock transformers padded, stock transformers packed
(sdpa with the mask it builds from position_ids), slipstream packed (with its chunked loss;
``--arms ...,slipstream-no-chunked-loss`` isolates the attention's share). Each arm in its own
process, interleaved over repeats, same weights and data; loss curves must agree.

    python benchmarks/packing.py [--batching sequential|bfd] [any `slipstream ab` option]

Target (issue 2, this 2-core CPU): slipstream >= 1.6x the better stock arm.
"""

from __future__ import annotations

import argparse
import csv
import io
from pathlib import Path

from slipstream.atomic import write_text_atomically
from slipstream.bench.command import ab_config_from_args, add_ab_arguments
from slipstream.bench.render import print_tables, write_record
from slipstream.bench.runner import run_ab

TARGET = 1.6


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_ab_arguments(
        parser,
        dict(
            model="qwen3-bench-cpu",
            max_seq_len=2048,
            steps=10,
            warmup=2,
            repeats=2,
            num_rows=3000,
            batching="sequential",
            out_dir="runs/bench-packing",
        ),
    )
    args = parser.parse_args()
    config = ab_config_from_args(args)
    record = run_ab(config)
    print_tables(record)
    out = Path(config.ab.out_dir)
    write_record(record, out)

    summary = record["summary"]
    stock_arms = [arm for arm in ("stock-padded", "stock-packed") if arm in summary]
    if "slipstream" not in summary or not stock_arms:
        print("the ratio needs the slipstream arm and at least one stock arm")
        return 2
    best_stock = max(stock_arms, key=lambda arm: summary[arm]["tokens_per_s"])
    ratio = summary["slipstream"]["tokens_per_s"] / summary[best_stock]["tokens_per_s"]
    reference = config.ab.arms[0]
    parity = {arm: summary[arm][f"loss_vs_{reference}"] for arm in summary}

    table = io.StringIO()
    writer = csv.writer(table)
    writer.writerow(
        ["arm", "tokens_per_s", "median_step_s", "peak_memory_mb", "host_syncs_per_step", "loss_parity"]
    )
    for arm, s in summary.items():
        writer.writerow(
            [
                arm,
                f"{s['tokens_per_s']:.1f}",
                f"{s['median_step_s']:.4f}",
                f"{s['peak_memory_mb']:.0f}",
                s["host_syncs_per_step"],
                parity[arm],
            ]
        )
    write_text_atomically(out / "packing.csv", table.getvalue())

    print(
        f"\nslipstream vs best stock arm ({best_stock}): {ratio:.2f}x  (target >= {TARGET}x: "
        f"{'met' if ratio >= TARGET else 'NOT met'})"
    )
    print(f"loss parity vs {reference}: {parity}")
    print(f"packing efficiency: {record['packing']['efficiency']:.1%}; results in {out}/")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
