"""Run the compatibility sweep over transformers' causal-LM registry; write docs/compatibility.md.

python benchmarks/compat_sweep.py                      # every architecture, 2 workers
python benchmarks/compat_sweep.py --workers 1          # one worker process (a busy machine)
python benchmarks/compat_sweep.py --types llama lfm2   # a few
python benchmarks/compat_sweep.py --compile            # also each architecture's compiled layers
                                                       # (inductor: ~50 s each on a 2-core CPU)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from pathlib import Path

from slipstream.atomic import write_text_atomically
from slipstream.compat import causal_lm_model_types, render_markdown, sweep


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--types", nargs="*", help="model types to check (default: the whole registry)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--markdown", type=Path, default=Path("docs/compatibility.md"))
    parser.add_argument("--json", type=Path, default=Path("docs/compatibility.json"))
    parser.add_argument(
        "--compile",
        action="store_true",
        help="also check each passing architecture with its decoder layers compiled (compile='on'); "
        "a cold inductor compile costs ~50 s per architecture on a 2-core CPU",
    )
    args = parser.parse_args(argv)
    types = args.types or causal_lm_model_types()
    started = time.perf_counter()

    def progress(verdict: dict) -> None:
        print(f"{verdict['status']:8s} {verdict['model_type']:28s} {verdict['detail'][:150]}", flush=True)

    verdicts = sweep(types, workers=args.workers, progress=progress, compile=args.compile)
    seconds = time.perf_counter() - started
    counts = Counter(v["status"] for v in verdicts)
    print(
        f"{len(verdicts)} architectures in {seconds:.0f} s: "
        + ", ".join(f"{k} {n}" for k, n in counts.most_common())
    )
    if not args.types:  # the table documents the whole registry only
        write_text_atomically(args.markdown, render_markdown(verdicts, seconds=seconds, workers=args.workers))
        print(f"wrote {args.markdown}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomically(
        args.json, json.dumps({"seconds": seconds, "verdicts": verdicts}, indent=1, default=str)
    )
    return 1 if counts.get("WRONG") or counts.get("CRASH") else 0


if __name__ == "__main__":
    sys.exit(main())
