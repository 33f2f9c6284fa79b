"""Each GGUF type of one run, as people deploy it: size, export time, agreement in both runtimes, and the same
figures for llama.cpp's own converter + quantizer on the same model (issue 64's table).

For every ``--quant`` given, ``export_gguf`` on the run (merged, written, quantized by llama.cpp's own quantizer
where it is a block type, verified) with llama.cpp's source for the reference, then one JSON line:

- the file's size and the export's wall time (the merge, the write, the quantizer, every check and the
  reference's conversion included);
- top-1 agreement with the merged model on the held prompts in transformers' GGUF loader and in llama.cpp,
  for our file and for the reference file, the floor each was held to;
- whether the per-tensor types are equal and the unquantized tensors byte-identical;
- the tensor mixture llama.cpp's quantizer chose.

    python benchmarks/gguf_types.py RUN_DIR --out-dir runs/i64 --source ~/.cache/slipstream-wheels/llama_cpp_python-0.3.36.tar.gz \
        --quant f16 q8_0 q6_k q5_k_m q4_k_m q3_k_m q2_k

Then ``benchmarks/gguf_recall.py`` asks the trained facts of each file through llama.cpp.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from slipstream.export import ExportError
from slipstream.export.gguf_export import export_gguf


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", type=Path)
    parser.add_argument("--out-dir", type=Path, required=True)
    parser.add_argument(
        "--source", required=True, help="llama.cpp's source: a checkout or llama-cpp-python's sdist"
    )
    parser.add_argument("--quant", nargs="+", default=["f16", "q8_0", "q6_k", "q5_k_m", "q4_k_m"])
    args = parser.parse_args()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    for quant in args.quant:
        out = args.out_dir / f"{args.run.name}-{quant}.gguf"
        started = time.perf_counter()
        try:
            report = export_gguf(args.run, out, quant=quant, overwrite=True, llama_cpp_source=args.source)
        except ExportError as error:
            print(json.dumps({"quant": quant, "refused": str(error)}), flush=True)
            continue
        ref = report.reference
        record = {
            "quant": quant,
            "mib": round(report.written["bytes"] / 2**20, 1),
            "export_s": round(time.perf_counter() - started, 1),
            "quantize_s": report.written.get("quantize_seconds"),
            "quantizer": report.written["quantizer"],
            "tensors": report.written["tensors"],
            "ours": {
                c.runtime: {"top1": round(c.top1, 4), "floor": round(c.floor, 4)} for c in report.checks
            },
            "reference": None
            if ref is None
            else {
                "top1": {c.runtime: round(c.top1, 4) for c in ref.checks},
                "types_equal": ref.types_equal,
                "base_identical": f"{ref.base_identical}/{ref.base_compared}",
                "seconds": round(ref.seconds, 1),
            },
            "skipped": report.skipped,
            "no_reference": report.no_reference,
        }
        print(json.dumps(record), flush=True)


if __name__ == "__main__":
    main()
