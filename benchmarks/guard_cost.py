"""What the packed-attention guards and the architecture verdict cost per training step.

The guards read Python objects only (kwargs, shapes, a context variable), so a packed step
should keep its host-sync count (0, see host_syncs.py) and its speed. This times one packed
forward + backward of each tiny test preset (random init, fp32, 5 documents in 2,048 tokens;
tiny, so the per-call Python overhead weighs as much as it ever can) with the guard function in
place and with it replaced by a bare lookup of the batch, interleaved, median of ``--repeats``.

    python benchmarks/guard_cost.py
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import slipstream
import slipstream.packing.attention.call as attention
from slipstream.models import build_model
from slipstream.packing import PACKED_BATCH_KWARG, collate_packed

LENGTHS = (200, 500, 300, 700, 348)


def bare_check(module, query, key, attention_mask, kwargs):
    return kwargs.get(PACKED_BATCH_KWARG)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--presets", nargs="*", default=["llama", "qwen3", "qwen3-moe", "gpt-oss"])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    guarded_check = attention.check_attention_call
    print("| preset | tokens | docs | unguarded ms | guarded ms | guarded / unguarded |")
    print("|---|---:|---:|---:|---:|---:|")
    for preset in args.presets:
        model = build_model(preset)
        slipstream.optimize(model)
        model.train()
        generator = torch.Generator().manual_seed(0)
        vocab = model.config.vocab_size
        docs = [{"input_ids": torch.randint(3, vocab, (n,), generator=generator).tolist()} for n in LENGTHS]
        batch = collate_packed(docs)

        def step(model=model, batch=batch) -> float:
            started = time.perf_counter()
            model(**batch.model_inputs()).loss.backward()
            model.zero_grad(set_to_none=True)
            return time.perf_counter() - started

        step(), step()  # warm-up
        times: dict[str, list[float]] = {"guarded": [], "unguarded": []}
        for _ in range(args.repeats):
            for arm, check in (("guarded", guarded_check), ("unguarded", bare_check)):
                attention.check_attention_call = check
                times[arm].append(step())
        attention.check_attention_call = guarded_check
        guarded, unguarded = statistics.median(times["guarded"]), statistics.median(times["unguarded"])
        print(
            f"| {preset} | {batch.num_tokens:,} | {len(LENGTHS)} | {unguarded * 1e3:.0f} | {guarded * 1e3:.0f} "
            f"| {guarded / unguarded:.3f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
