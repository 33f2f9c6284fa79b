"""Host syncs per packed forward + backward, stock transformers vs slipstream, per model family.

Counts the ATen ops that read a device value back to the host (``_local_scalar_dense``,
``item``, ``nonzero``, ``is_nonzero``, ``equal``) with a TorchDispatchMode. The count does
not depend on the hardware, so a CPU run tells what a GPU run would pay in stalls. Also
reports the largest tensor allocated, to show the dense [T, T] mask of the stock path.

    python benchmarks/host_syncs.py [--tokens 2048]
    python benchmarks/host_syncs.py --moe     # MoE layers: stock eager / grouped_mm vs sorted routing
"""

from __future__ import annotations

import argparse

import torch

import slipstream
from slipstream.bench.counters import HostSyncCounter, LargeTensorWatch
from slipstream.models import build_model, preset_vocab_size
from slipstream.packing import collate_padded

FAMILIES = ("llama", "qwen3", "qwen3-moe", "gpt-oss")


def measure(model, inputs) -> tuple[int, dict, int]:
    watch = LargeTensorWatch(min_numel=1 << 62)
    with HostSyncCounter() as syncs, watch:
        model(**inputs).loss.backward()
    model.zero_grad(set_to_none=True)
    return syncs.total, dict(syncs.by_op), watch.largest_numel


def moe_table(tokens: int) -> None:
    """Host syncs of one forward of the MoE benchmark shapes, per routing implementation."""
    generator = torch.Generator().manual_seed(0)
    lengths = [tokens * 3 // 10, tokens // 2]
    lengths.append(tokens - sum(lengths))
    docs = [{"input_ids": torch.randint(1, 2048, (n,), generator=generator).tolist()} for n in lengths]
    print(f"T = {tokens} tokens, one forward, packed attention in every arm\n")
    print("| shape | experts | host syncs per forward | per MoE layer |\n|---|---|---:|---:|")
    arms = (
        ("stock eager", "eager", "stock", "auto"),
        ("stock grouped_mm", "grouped_mm", "stock", "auto"),
        ("slipstream sorted (grouped_mm)", None, "sorted", "grouped_mm"),
        ("slipstream sorted (loop)", None, "sorted", "loop"),
    )
    for shape in ("qwen3-moe-bench-cpu", "gpt-oss-bench-cpu"):
        for arm, experts, routing, compute in arms:
            overrides = {"experts_implementation": experts} if experts else {}
            model = build_model(shape, vocab_size=preset_vocab_size(shape) or 2048, **overrides)
            slipstream.optimize(model, moe_routing=routing, moe_compute=compute)
            batch = slipstream.collate_packed(docs)
            with torch.no_grad(), HostSyncCounter() as syncs:
                model(**batch.model_inputs())
            layers = model.config.num_hidden_layers
            print(f"| {shape} | {arm} | {syncs.total} | {syncs.total / layers:.1f} |")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", type=int, default=2048, help="tokens in the packed row")
    parser.add_argument("--moe", action="store_true", help="count MoE routing syncs instead")
    args = parser.parse_args()
    if args.moe:
        moe_table(args.tokens)
        return
    generator = torch.Generator().manual_seed(0)
    lengths = [args.tokens // 8] * 4 + [args.tokens // 4] * 2
    lengths[-1] += args.tokens - sum(lengths)
    docs = [{"input_ids": torch.randint(1, 512, (n,), generator=generator).tolist()} for n in lengths]
    batch = slipstream.collate_packed(docs)
    print(
        f"T = {batch.num_tokens} tokens in {batch.num_docs} documents; T x T = {batch.num_tokens**2:,} elements\n"
    )
    print("| family | arm | host syncs per fwd+bwd | by op | largest tensor (elements) |")
    print("|---|---|---:|---|---:|")
    for family in FAMILIES:
        model = build_model(family)
        stock_attn = model.config._attn_implementation
        arms = [
            (f"stock padded ({stock_attn})", collate_padded(docs)),
            (f"stock packed ({stock_attn})", batch.stock_inputs()),
        ]
        for arm, inputs in arms:
            total, by_op, largest = measure(model, inputs)
            print(f"| {family} | {arm} | {total} | {by_op or '-'} | {largest:,} |")
        slipstream.optimize(model)
        total, by_op, largest = measure(model, batch.model_inputs())
        print(
            f"| {family} | slipstream ({model.config._attn_implementation}) | {total} | {by_op or '-'} | {largest:,} |"
        )


if __name__ == "__main__":
    main()
