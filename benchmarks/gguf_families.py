"""Every family and tokenizer kind `slipstream export --gguf` writes, exported and verified the way a user's
export is (both runtimes where llama.cpp is installed): one row per family, runtime and type, with top-1
agreement, max |logit difference|, greedy continuations, the tokenization probes and the wall time.

The models are the test suite's tiny random ones (tests/export/test_gguf.py's builders: every family key set
so that it changes the output, heads sharpened so a top-1 is not a near-tie); the real model's figures are
BENCHMARKS.md's SmolLM2 rows. Run from the repository root:

    python benchmarks/gguf_families.py --quant f16 --out runs/gguf-families.md
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the tests' builders


def _families(root: Path) -> dict[str, Path]:
    from tests.export.spm_tokenizer import save_spm_tokenizer
    from tests.export.test_gguf import (
        _gemma_dir,
        _llama3_rope_dir,
        _moe_dir,
        _qwen2_dir,
        _qwen_split_demo_tokenizer,
        _sharpened,
    )

    from slipstream.data import demo_tokenizer
    from slipstream.models import build_model

    def llama(name: str, tokenizer) -> Path:
        path = root / name
        build_model("llama", vocab_size=len(tokenizer), dtype=torch.float32).save_pretrained(path)
        tokenizer.save_pretrained(path)
        return _sharpened(path)

    demo = demo_tokenizer()
    demo.bos_token = demo.eos_token
    spm = save_spm_tokenizer(root / "spm-tokenizer")
    gemma_spm = save_spm_tokenizer(
        root / "gemma-tokenizer", spacing="gemma", tokenizer_class="GemmaTokenizer"
    )
    return {
        "llama, byte-level BPE": llama("llama", demo),
        "llama, SentencePiece (Llama 2 spacing)": llama("llama-spm", spm),
        "llama, Llama 3.1 RoPE scaling (rope_freqs)": _llama3_rope_dir(root),
        "qwen2 (biases)": _qwen2_dir(root),
        "qwen3_moe (8 experts, top 2)": _moe_dir(root, "qwen3-moe", _qwen_split_demo_tokenizer()),
        "mixtral (4 experts, top 2)": _moe_dir(root, "mixtral", demo),
        "gemma2 (window 8, soft-caps)": _gemma_dir(root, "gemma2"),
        "gemma3_text (window 8, local base, linear x8)": _gemma_dir(root, "gemma3_text"),
        "gemma3_text, SentencePiece (Gemma spacing)": _gemma_dir(root / "g3spm", "gemma3_text", gemma_spm),
    }


def main() -> None:
    from slipstream.export.gguf_export import export_gguf

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quant", default="f16")
    parser.add_argument("--out", type=Path, default=None, help="write the markdown table here too")
    args = parser.parse_args()
    lines = [
        "| family | runtime | top-1 | max \\|Δ logit\\| | greedy identical | tokenization probes | export + checks |",
        "|---|---|---:|---:|---:|---|---:|",
    ]
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch)
        for family, source in _families(root).items():
            started = time.perf_counter()
            report = export_gguf(source, root / f"{source.parent.name}-{source.name}.gguf", quant=args.quant)
            seconds = time.perf_counter() - started
            for check in report.checks:
                probes = (
                    "-" if not check.probes else ("identical" if check.probe_mismatch is None else "differ")
                )
                lines.append(
                    f"| {family} | {check.runtime} | {check.top1:.1%} | {check.max_abs:.3g} | "
                    f"{check.greedy_same} of {check.greedy_total} | {probes} ({check.probes}) | {seconds:.1f} s |"
                )
            lines += [f"| {family} | {reason} | | | | | |" for reason in report.skipped]
    table = "\n".join(lines)
    print(table)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(table + "\n")


if __name__ == "__main__":
    main()
