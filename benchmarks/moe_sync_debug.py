"""GPU only: host syncs of one MoE training step, seen by CUDA's own sync debugger.

Runs one forward + backward of a few-layer GPT-OSS-20B- or Qwen3-30B-A3B-shaped model (bf16,
random init) under ``torch.cuda.set_sync_debug_mode("warn")`` for stock eager experts and for
slipstream's sorted routing, and counts the warnings CUDA raises (each one a synchronizing
call). Writes a small table.

    python benchmarks/moe_sync_debug.py [--shape gpt-oss-20b --layers 2 --tokens 2048]
"""

from __future__ import annotations

import argparse
import warnings

import torch


def count_sync_warnings(model, batch) -> int:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            model(**batch.model_inputs()).loss.backward()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    return sum("synchroniz" in str(w.message).lower() for w in caught)


def main() -> None:
    import slipstream
    from slipstream.models import build_model, preset_vocab_size

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shapes", default="gpt-oss-20b,qwen3-30b-a3b")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=2048)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("moe_sync_debug.py needs a CUDA GPU")
    generator = torch.Generator().manual_seed(0)
    lengths = [args.tokens // 4] * 4
    docs = [{"input_ids": torch.randint(1, 2048, (n,), generator=generator).tolist()} for n in lengths]
    print("| shape | experts | sync warnings in one fwd+bwd |\n|---|---|---:|")
    for shape in args.shapes.split(","):
        for arm, experts in (("stock eager", "eager"), ("slipstream sorted", None)):
            overrides = {"experts_implementation": experts} if experts else {}
            model = build_model(
                shape,
                vocab_size=preset_vocab_size(shape) or 2048,
                layers=args.layers,
                dtype=torch.bfloat16,
                **overrides,
            ).cuda()
            slipstream.optimize(model, moe_routing="sorted" if experts is None else "stock")
            batch = slipstream.collate_packed(docs, device="cuda")
            model(**batch.model_inputs()).loss.backward()  # warm-up
            print(f"| {shape} | {arm} | {count_sync_warnings(model, batch)} |", flush=True)
            del model
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
