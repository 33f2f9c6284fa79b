#!/usr/bin/env bash
# Every GPU check in one run (< 8 minutes on one H200). Results go under $OUT (default ./out).
# The lent machine has torch and transformers but may lack our other deps; we install
# slipstream without touching its torch.
set -uo pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
{
  nvidia-smi || true
  python -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
  pip install -q --no-deps -e . 2>&1 | tail -2
  pip install -q tokenizers pyarrow pyyaml tqdm rich psutil 2>&1 | tail -2
} > "$OUT/env.txt" 2>&1

# 1. GPU tests: no host sync in a packed step (sync debug mode "error"), varlen backend used.
timeout 180 python -m pytest -q -m gpu tests/packing/test_gpu.py -p no:cacheprovider > "$OUT/gpu_tests.txt" 2>&1
echo "gpu tests exit: $?" >> "$OUT/gpu_tests.txt"

# 2. Packing A/B on the GPU: Qwen3-0.6B shape cut to 8 layers, bf16, 2048-token bins.
timeout 240 python benchmarks/packing.py --model qwen3-0.6b --layers 8 --device cuda --dtype bfloat16 \
  --steps 12 --warmup 3 --repeats 2 --out "$OUT/bench-packing" > "$OUT/bench_packing.txt" 2>&1
echo "packing bench exit: $?" >> "$OUT/bench_packing.txt"
