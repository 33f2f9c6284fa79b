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

# 1. Packing (issue 2): no host sync in a packed step (sync debug "error"), varlen backend used.
timeout 100 python -m pytest -q -m gpu tests/packing/test_gpu.py -p no:cacheprovider > "$OUT/gpu_tests.txt" 2>&1
echo "gpu tests exit: $?" >> "$OUT/gpu_tests.txt"

# 2. Packing A/B on the GPU: Qwen3-0.6B shape cut to 8 layers, bf16, 2048-token bins.
timeout 90 python benchmarks/packing.py --model qwen3-0.6b --layers 8 --device cuda --dtype bfloat16 \
  --steps 10 --warmup 3 --repeats 1 --out "$OUT/bench-packing" > "$OUT/bench_packing.txt" 2>&1
echo "packing bench exit: $?" >> "$OUT/bench_packing.txt"

# 3. MoE (issue 3): sorted routing vs stock eager / grouped_mm in bf16 on GPT-OSS-20B and
#    Qwen3-30B-A3B layer shapes (2 layers, random init), and sync counts under CUDA's debugger.
timeout 130 python benchmarks/moe.py --shapes gpt-oss-20b,qwen3-30b-a3b --layers 2 --device cuda \
  --dtype bfloat16 --tokens 4096 --steps 4 --warmup 1 --out "$OUT/bench-moe" > "$OUT/bench_moe.txt" 2>&1
echo "moe bench exit: $?" >> "$OUT/bench_moe.txt"
timeout 45 python benchmarks/moe_sync_debug.py > "$OUT/moe_sync_debug.txt" 2>&1
echo "moe sync debug exit: $?" >> "$OUT/moe_sync_debug.txt"

# 4. Offloaded checkpointing (issue 4): off / recompute / offload / offload-double on a
#    Qwen3-8B shape (8 layers, bf16, LoRA), 8192-token packed batches.
timeout 120 python benchmarks/offload.py --layers 8 --tokens 8192 --steps 5 --warmup 2 \
  --out "$OUT/bench-offload" > "$OUT/bench_offload.txt" 2>&1
echo "offload bench exit: $?" >> "$OUT/bench_offload.txt"
